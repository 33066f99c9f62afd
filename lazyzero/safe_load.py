"""Checkpoint files are read without running code (docs/reliability.md, guarantee 2).

`torch.load(weights_only=True)` unpickles tensors, containers and numbers only; any other type in
the file must be allowlisted. DeepSpeed's own files hold a few of its classes (the ZeRO stage enum,
the loss scaler, the fragment addresses of ZeRO 1/2 parameter slices): those, and nothing else, are
allowed here. A file that needs another type is refused with an error naming the file, the type and
the opt-out (`lazyzero.checkpoint.allow_pickle`), for folders the user trusts.
"""

from __future__ import annotations

import importlib
import os
import pickle
from typing import BinaryIO

import torch

# "module:attribute" of every non-builtin type a DeepSpeed or lazyzero checkpoint file holds, as
# `torch.serialization.get_unsafe_globals_in_checkpoint` lists them for files saved at ZeRO stages
# 0-3, fp32/fp16/bf16, with and without offload (tests/checkpoint/test_safe_load.py checks this).
ALLOWED_GLOBALS = (
    "deepspeed.runtime.zero.config:ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",
    "deepspeed.utils.tensor_fragment:fragment_address",
)
OPT_OUT_KEY = "lazyzero.checkpoint.allow_pickle"


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file that cannot be loaded without running code it names."""


def allowed_types() -> list[type]:
    """The allowlisted types this DeepSpeed has (an older one may lack some; its files cannot hold them)."""
    types = []
    for entry in ALLOWED_GLOBALS:
        module_name, _, attribute = entry.partition(":")
        try:
            types.append(getattr(importlib.import_module(module_name), attribute))
        except (ImportError, AttributeError):
            continue
    return types


def pickle_allowed(lazyzero_config) -> bool:
    """The opt-out, from the engine's lazyzero config (the re-splits read checkpoints DeepSpeed saved
    with or without lazy checkpoints)."""
    return bool(getattr(lazyzero_config.checkpoint, "allow_pickle", False))


def load_checkpoint_file(path: str | os.PathLike | BinaryIO, map_location=None, allow_pickle: bool = False,
                         label: str | os.PathLike | None = None, **options):
    """torch.load of `path` (a file name, or a binary file object whose name for errors is `label`) that
    runs no code unless `allow_pickle`; `options` go to torch.load (mmap)."""
    if allow_pickle:
        return torch.load(path, map_location=map_location, weights_only=False, **options)
    try:
        with torch.serialization.safe_globals(allowed_types()):
            return torch.load(path, map_location=map_location, weights_only=True, **options)
    except pickle.UnpicklingError:  # what torch raises when the restricted unpickler meets a global
        raise UnsafeCheckpointFile(_refusal(path, path if label is None else label)) from None


def _refusal(source: str | os.PathLike | BinaryIO, path: str | os.PathLike) -> str:
    if hasattr(source, "seek"):
        source.seek(0)
    unsafe = _unsafe_globals(source)
    what = ", ".join(unsafe) if unsafe else "an object that is not a tensor, container or number"
    return (f"{path}: refusing to load a checkpoint file that holds {what}: loading it would run code it names. "
            f"lazyzero loads only tensors, containers, numbers and {', '.join(ALLOWED_GLOBALS)}. If you trust this "
            f"folder, set {OPT_OUT_KEY}: true")


def _unsafe_globals(path: str | os.PathLike | BinaryIO) -> list[str]:
    """The file's globals that are neither torch's defaults nor allowlisted (empty when unreadable)."""
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in allowed_types()}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a damaged file: the load's own error was about that, the refusal says what it can
        return []
    return [name for name in found if name not in allowed]
