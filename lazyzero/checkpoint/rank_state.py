"""lazyzero's own per-rank checkpoint file, next to DeepSpeed's files of the same tag.

DeepSpeed saves what its engine and optimizer hold; state that lazyzero features keep per rank
(the error-feedback residuals of int8 gradients; under lazy checkpoints also the RNG states) goes
into `lazyzero_rank<R>.pt` in the tag's folder. It is written through the engine's checkpoint
engine inside DeepSpeed's save, so it is part of the same commit as DeepSpeed's files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from lazyzero.safe_load import load_checkpoint_file

FILE_FORMAT = 1


def rank_state_path(tag_dir: str | os.PathLike, rank: int) -> Path:
    return Path(tag_dir) / f"lazyzero_rank{rank:05d}.pt"


def rank_state_document(rank: int, world_size: int, features: dict) -> dict:
    """What `lazyzero_rank<R>.pt` holds: feature name -> state, with the layout it belongs to."""
    return {"format": FILE_FORMAT, "rank": rank, "world_size": world_size, "features": features}


def load_rank_state(tag_dir: str | os.PathLike, rank: int, world_size: int,
                    load: Callable = lambda path: load_checkpoint_file(path, "cpu")) -> tuple[dict | None, str]:
    """The features saved by `rank` of a run of `world_size` ranks, or None and why not. `load` reads
    the file without running code (lazyzero/safe_load.py; the engine passes its verified reader)."""
    path = rank_state_path(tag_dir, rank)
    if not os.path.lexists(path):
        return None, f"{path} does not exist"
    saved = load(str(path))
    if not isinstance(saved, dict) or saved.get("format") != FILE_FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{path}: format {found!r}; this lazyzero reads {FILE_FORMAT}")
    if not isinstance(saved.get("world_size"), int) or not isinstance(saved.get("features"), dict):
        raise ValueError(f"{path}: expected an integer 'world_size' and a dict 'features' (lazyzero rank state, "
                         f"format {FILE_FORMAT})")
    if saved["world_size"] != world_size:
        return None, f"{path} was saved by a run of {saved['world_size']} ranks, this run has {world_size}"
    return saved["features"], ""
