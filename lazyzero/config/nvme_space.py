"""Room for ZeRO's NVMe swap files, checked at start (docs/reliability.md, guarantee 4: a write that
cannot fit fails before it starts, naming the folder, the bytes needed and the bytes free).

DeepSpeed creates its swap files as the engine is built and fills them during the first steps; a
folder without room for them fails there, deep inside an aio write. What those files take at least,
per rank: each parameter partition at the training dtype (offload_param), and each fp32 master
partition with its optimizer states (offload_optimizer: Adam's two moments in fp32, or 2 bytes of
8-bit codes with lazyzero's optimizer). Every rank of a node writes into the same folder.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from lazyzero.config.errors import Problem

ADAM_TYPES = {"adam", "adamw", "cpuadam", "fusedadam", "onebitadam", "zerooneadam", "onebitlamb", "lamb"}
EIGHT_BIT_STATE_BYTES = 2  # two 1-byte moment codes per parameter (block scales are not counted)


def nvme_swap_problems(ds_config: dict, parameter_count: int, world_size: int, ranks_on_node: int) -> list[Problem]:
    """A problem per NVMe folder whose filesystem lacks room for the swap files of this node's ranks."""
    zero = ds_config.get("zero_optimization") or {}
    per_rank = math.ceil(parameter_count / world_size)
    needs: dict[str, tuple[str, int]] = {}  # folder -> (key, bytes needed on this node)
    for key, bytes_per_param in (("offload_param", _parameter_bytes(ds_config)),
                                 ("offload_optimizer", _optimizer_bytes(ds_config))):
        offload = zero.get(key) or {}
        if offload.get("device") != "nvme" or not offload.get("nvme_path"):
            continue
        folder = os.path.realpath(offload["nvme_path"])
        earlier_key, earlier = needs.get(folder, ("", 0))
        joined_key = f"{earlier_key} and " if earlier_key else ""
        needs[folder] = (f"{joined_key}zero_optimization.{key}.nvme_path",
                         earlier + per_rank * bytes_per_param * ranks_on_node)
    return [problem for folder, (key, needed) in needs.items() if (problem := _room_problem(key, folder, needed))]


def ranks_on_this_node(world_size: int) -> int:
    """How many ranks share this host's folders: what the launcher says, else all of them."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return world_size


def _parameter_bytes(ds_config: dict) -> int:
    low_precision = any((ds_config.get(name) or {}).get("enabled") for name in ("fp16", "bf16"))
    return 2 if low_precision else 4


def _optimizer_bytes(ds_config: dict) -> int:
    """fp32 master weights, and the states whose size is known for the configured optimizer."""
    optimizer = (ds_config.get("optimizer") or {}).get("type", "")
    if ((ds_config.get("lazyzero") or {}).get("optimizer") or {}).get("enabled"):
        return 4 + EIGHT_BIT_STATE_BYTES
    return 4 + (8 if str(optimizer).lower().replace("_", "") in ADAM_TYPES else 0)


def _room_problem(key: str, folder: str, needed: int) -> Problem | None:
    """None when the filesystem holding `folder` has `needed` bytes, counting the swap files an earlier
    run left there (DeepSpeed's `zero_stage_*` folders), which this run overwrites."""
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    reusable = sum(path.stat().st_size for stage in Path(folder).glob("zero_stage_*") for path in stage.rglob("*")
                   if path.is_file() and not path.is_symlink())
    if needed <= free + reusable:
        return None
    return Problem(key, f"{folder} has {free + reusable:,} bytes free (swap files of earlier runs included); "
                        f"this node's ranks need at least {needed:,} for their NVMe swap files. Free space there, "
                        "choose a larger filesystem, or offload to the CPU instead")
