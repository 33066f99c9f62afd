"""The host's cores shared among the CPU ranks a launcher started on it (docs/trainers.md).

Neither the deepspeed launcher nor mpirun sets OMP_NUM_THREADS, so every rank's torch would use
every core and the ranks of a host would thrash. Accelerate divides the cores by LOCAL_WORLD_SIZE,
which neither launcher sets either (the deepspeed launcher sets LOCAL_SIZE, Open MPI
OMPI_COMM_WORLD_LOCAL_SIZE), so under `deepspeed --num_gpus 2` it gives each rank all the cores.
"""

from __future__ import annotations

import os

# Where launchers say how many ranks they started on this host: deepspeed, Open MPI, torchrun.
LAUNCHER_LOCAL_SIZE = ("LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")


def share_cpu_cores() -> int | None:
    """Give this rank its share of the host's cores (at least one) when a launcher started it, it
    computes on the CPU and OMP_NUM_THREADS does not say otherwise; also set OMP_NUM_THREADS, which
    Accelerate then honours. Returns the threads set, or None when nothing was changed."""
    import torch

    local_ranks = next((int(os.environ[k]) for k in LAUNCHER_LOCAL_SIZE if k in os.environ), None)
    if local_ranks is None or torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return None
    threads = max(1, (os.cpu_count() or 1) // local_ranks)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads
