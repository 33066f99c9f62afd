"""Accelerate's count of CPU ranks under `lazyzero.patch_deepspeed()` (lazyzero/engine/accelerate_ranks.py):
`PartialState._prepare_backend` answers with DeepSpeed's CPU backend for the CPU ranks of a multi-rank
launch only, and leaves every other case as Accelerate decides it. The launches themselves (each rank on
its own shard; a state built before the patch refused) are in tests/app/test_trainers.py."""

import pytest

pytest.importorskip("accelerate")

from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import lazyzero  # noqa: E402


@pytest.fixture
def routed():
    lazyzero.patch_deepspeed()
    yield
    lazyzero.unpatch_deepspeed()


def backend(cpu=False, backend=None):
    return PartialState._prepare_backend(PartialState.__new__(PartialState), cpu, False, backend)


def test_cpu_ranks_of_a_launch_get_deepspeeds_cpu_backend(monkeypatch, routed):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert backend() == ("gloo", DistributedType.NO)  # PartialState then counts torch.distributed's ranks
    assert backend(backend="gloo") == ("gloo", DistributedType.NO)  # as InitProcessGroupKwargs(backend="gloo")
    assert backend(cpu=True) == ("gloo", DistributedType.MULTI_CPU)  # Accelerate's own answer, DeepSpeed off
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert backend() == (None, DistributedType.NO)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert backend() == (None, DistributedType.NO)  # no launcher's rank: one process, as Accelerate says


def test_unpatch_gives_accelerate_its_own_method_back(monkeypatch, routed):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    lazyzero.unpatch_deepspeed()
    assert backend() == (None, DistributedType.NO)
    assert not hasattr(PartialState._prepare_backend, "__wrapped__")
