"""lazyzero's own per-rank checkpoint file, next to DeepSpeed's files of the same tag.

DeepSpeed saves what its engine and optimizer hold; state that lazyzero features keep per rank
(the error-feedback residuals of int8 gradients) goes into `lazyzero_rank<R>.pt` in the tag's
folder. It is written before DeepSpeed's files and its 'latest' marker, under a temporary name
renamed into place, so a checkpoint that 'latest' points to always has it complete.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

FILE_FORMAT = 1


def rank_state_path(tag_dir: str | os.PathLike, rank: int) -> Path:
    return Path(tag_dir) / f"lazyzero_rank{rank:05d}.pt"


def save_rank_state(tag_dir: str | os.PathLike, rank: int, world_size: int, features: dict) -> Path:
    """Write `features` (feature name -> state) for `rank` atomically; returns the path."""
    path = rank_state_path(tag_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save({"format": FILE_FORMAT, "rank": rank, "world_size": world_size, "features": features}, partial)
    os.replace(partial, path)
    return path


def load_rank_state(tag_dir: str | os.PathLike, rank: int, world_size: int) -> tuple[dict | None, str]:
    """The features saved by `rank` of a run of `world_size` ranks, or None and why not."""
    path = rank_state_path(tag_dir, rank)
    if not path.is_file():
        return None, f"{path} does not exist"
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved.get("format") != FILE_FORMAT:
        raise ValueError(f"{path}: format {saved.get('format')!r}; this lazyzero reads {FILE_FORMAT}")
    if saved["world_size"] != world_size:
        return None, f"{path} was saved by a run of {saved['world_size']} ranks, this run has {world_size}"
    return saved["features"], ""
