"""DeepSpeed's CPU shared-memory all-reduce leaves one 66 MB file per rank in /dev/shm, forever.

DeepSpeed 0.19.8's `shm_initialize` (ops/csrc/cpu/comm/shm.cpp) creates
/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank> for every rank of a
single-node CPU run, maps every rank's file, and never unlinks them: each run leaks
world_size x 66 MB of RAM (tmpfs) until reboot. Once every rank has mapped every file (they all
have, when `init_distributed` has returned on every rank), the names can go: the mappings stay
valid until the processes exit, and the memory is freed with them.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"


def segment_paths(port: int | str, rank: int | str = "*", addr: str = "*") -> list[Path]:
    """The segment files of a run on `port` (one rank's, or all with the default '*')."""
    return sorted(SHM_DIR.glob(f"{PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"))


def release_own_segment_name(dist) -> None:
    """Unlink this rank's segment name after every rank has mapped every segment (a barrier on
    `dist`, DeepSpeed's comm module, initialized)."""
    port = os.environ.get("MASTER_PORT")
    if port is None:
        return
    dist.barrier()
    for path in segment_paths(port, dist.get_rank(), os.environ.get("MASTER_ADDR", "*")):
        path.unlink(missing_ok=True)


def remove_leftover_segments(port: int) -> None:
    """Remove every segment of a finished run on `port` (test launchers: workers that never
    called `release_own_segment_name`, or that crashed)."""
    for path in segment_paths(port):
        path.unlink(missing_ok=True)
