"""The MPI extra's refusals (lazyzero/distributed/mpi_extra.py): named install command, no bare ImportError."""

import importlib.util

import pytest

from lazyzero.distributed import mpi_extra
from lazyzero.distributed.launch import launch_command

MPIRUN_RANK = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}
DEEPSPEED_RANK = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                  "LOCAL_RANK": "0"}


@pytest.fixture
def without_mpi4py(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))


def test_rank_of_mpirun_without_mpi4py_names_the_extra(without_mpi4py):
    with pytest.raises(RuntimeError, match=r"lazyzero\[mpi\]"):
        mpi_extra.check_mpi_discovery_possible(MPIRUN_RANK)


@pytest.mark.parametrize("environ", [DEEPSPEED_RANK, {**MPIRUN_RANK, **DEEPSPEED_RANK}, {}])
def test_ranks_that_need_no_mpi_discovery_pass_without_mpi4py(without_mpi4py, environ):
    mpi_extra.check_mpi_discovery_possible(environ)


def test_mpirun_rank_with_mpi4py_passes():
    pytest.importorskip("mpi4py")
    mpi_extra.check_mpi_discovery_possible(MPIRUN_RANK)


def test_mpirun_launch_without_mpirun_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"no mpirun on PATH.*lazyzero\[mpi\]"):
        launch_command("mpirun", 2, ["script.py"])
