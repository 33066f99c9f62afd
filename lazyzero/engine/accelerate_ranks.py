"""Accelerate on CPU ranks under a multi-rank launch (docs/trainers.md).

Accelerate counts its processes when its state is first built (`PartialState.__init__`): it asks
`_prepare_backend` for the distributed backend of the machine's accelerator and, with the CPU device,
gets none; no backend means one process, although under `deepspeed --num_gpus N` it has just started
DeepSpeed's distributed backend on every rank (with `Accelerator(deepspeed_plugin=...)`). Every rank
then trains on the same batches, "auto" batch sizes are filled in for one rank, and the ranks save
their random states into one file. Accelerate's `cpu=True`, which would count the ranks, turns
DeepSpeed off (`AcceleratorState.__init__`, "and not cpu").

`lazyzero.patch_deepspeed()` routes `_prepare_backend` so that in that case only (not `cpu`, a
launcher's LOCAL_RANK and WORLD_SIZE above 1, DeepSpeed's accelerator the CPU, no backend found) it
answers with DeepSpeed's backend for the CPU, as `Accelerator(kwargs_handlers=[InitProcessGroupKwargs(
backend="gloo")])` would: Accelerate then counts torch.distributed's ranks, gives each rank its own
shard and saves each rank's random states. A state built before the patch keeps its count, and
`lazyzero.initialize` refuses to build an engine under it (`check_accelerate_counts_every_rank`).
"""

from __future__ import annotations

import importlib.util
import os
import sys

OWNER = "lazyzero.patch_deepspeed"


class LaunchRefused(RuntimeError):
    """A launch under which lazyzero would train wrongly; the message says how to launch instead."""


def prepare_backend_counting_cpu_ranks(self, cpu=False, sagemaker_dp=False, backend=None):
    """`PartialState._prepare_backend`, with DeepSpeed's CPU backend where Accelerate finds none for
    the CPU ranks of a multi-rank launch."""
    from accelerate.state import PartialState

    found, distributed_type = PartialState._prepare_backend.__wrapped__(self, cpu, sagemaker_dp, backend)
    if found is None and not cpu and _cpu_ranks_of_a_launch():
        from deepspeed.accelerator import get_accelerator

        return get_accelerator().communication_backend_name(), distributed_type
    return found, distributed_type


def _cpu_ranks_of_a_launch() -> bool:
    from deepspeed.accelerator import get_accelerator

    return (int(os.environ.get("LOCAL_RANK", -1)) != -1 and int(os.environ.get("WORLD_SIZE", 1)) > 1
            and get_accelerator().device_name() == "cpu")


def check_accelerate_counts_every_rank() -> None:
    """LaunchRefused when an Accelerate state exists and counts fewer processes than the job has ranks."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.is_initialized():
        return
    counted, ranks = state.PartialState().num_processes, _ranks()
    if ranks is None or counted == ranks:
        return
    raise LaunchRefused(
        f"Accelerate counts {counted} process(es) but the job has {ranks} ranks, so every rank would train on the "
        "same batches: on CPU ranks Accelerate finds no distributed backend unless lazyzero.patch_deepspeed() ran "
        "before its state was built, and it sees the ranks of the deepspeed launcher only (it reads LOCAL_RANK). "
        "Call lazyzero.patch_deepspeed() before the script builds its Accelerator (or any PartialState), and "
        "launch with: deepspeed --num_gpus N script.py")


def _ranks() -> int | None:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else None


def route_accelerate_rank_count() -> bool:
    """Route `PartialState._prepare_backend` (where Accelerate is installed); whether it is routed."""
    if importlib.util.find_spec("accelerate") is None:
        return False
    from accelerate.state import PartialState

    from lazyzero.patch_point import route_function

    route_function(PartialState, "_prepare_backend", prepare_backend_counting_cpu_ranks, owner=OWNER)
    return True


def unroute_accelerate_rank_count() -> None:
    from lazyzero.patch_point import unroute_function

    if "accelerate.state" in sys.modules:
        unroute_function(sys.modules["accelerate.state"].PartialState, "_prepare_backend", owner=OWNER)
