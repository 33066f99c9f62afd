"""MPI is an optional extra (pyproject.toml `mpi`: mpi4py and the Open MPI wheel): most users launch
with `deepspeed` or a trainer's launcher. Where a job is started by mpirun, or a test or benchmark
asks for mpirun, a missing extra is refused here with the install command instead of failing inside
DeepSpeed's MPI discovery with a bare ImportError."""

from __future__ import annotations

import importlib.util
import os
import shutil

MPI_INSTALL = "pip install 'lazyzero[mpi]'"

# What DeepSpeed's init_distributed needs to skip MPI discovery (deepspeed/comm/comm.py).
_DEEPSPEED_RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
# Set by Open MPI's mpirun (OMPI_*) and by PMIx launchers (PMIX_RANK) in every rank.
_MPI_RANK_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")


def mpirun_executable() -> str:
    """The mpirun on PATH, or an error naming the extra that provides one."""
    runner = shutil.which("mpirun")
    if runner is None:
        raise RuntimeError(f"launcher 'mpirun': no mpirun on PATH; install the MPI extra: {MPI_INSTALL}")
    return runner


def check_mpi_discovery_possible(environ=os.environ) -> None:
    """Before DeepSpeed's init_distributed: a rank that only MPI can place (started by mpirun, without
    the variables the deepspeed launcher sets) needs mpi4py; refuse its absence by name."""
    discovers_by_mpi = any(key in environ for key in _MPI_RANK_ENV) and not all(
        key in environ for key in _DEEPSPEED_RENDEZVOUS_ENV)
    if discovers_by_mpi and importlib.util.find_spec("mpi4py") is None:
        raise RuntimeError("this rank was started by an MPI launcher, and DeepSpeed finds its rank through "
                           f"mpi4py, which is not installed; install the MPI extra: {MPI_INSTALL}")
