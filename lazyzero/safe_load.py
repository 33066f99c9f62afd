"""Checkpoint files are read without running code (docs/reliability.md, guarantee 2).

`torch.load(weights_only=True)` unpickles tensors, containers and numbers only; any other type in
the file must be allowlisted. DeepSpeed's own files hold a few of its classes (the ZeRO stage enum,
the loss scaler, the fragment addresses of ZeRO 1/2 parameter slices): those, and nothing else, are
allowed here. A file that needs another type is refused with an error naming the file, the type and
the opt-out (`lazyzero.checkpoint.allow_pickle`), for folders the user trusts. A file torch cannot
read at all (damaged, or not torch's) is an error naming it and what torch found, never torch's
bare KeyError or EOFError; a file in torch's legacy (non-zip) format loads without memory mapping,
which torch supports for zip files only.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
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


class UnreadableCheckpointFile(ValueError):
    """A checkpoint file torch cannot read: damaged, or not written by torch.save."""


# torch.save's zip format starts with a zip local file header; the legacy format with a pickle.
ZIP_MAGIC = b"PK\x03\x04"
# What torch.load raises for a file it cannot parse (a truncated zip, garbage, an empty file).
_PARSE_ERRORS = (EOFError, KeyError, RuntimeError, ValueError, IndexError, OverflowError)


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
    runs no code unless `allow_pickle`; `options` go to torch.load (mmap, ignored for a legacy file).
    UnsafeCheckpointFile or UnreadableCheckpointFile name the file, the reason and what to do."""
    label = path if label is None else label
    if options.get("mmap") and not is_zip_format(path):
        options = {**options, "mmap": False}
    try:
        if allow_pickle:
            return torch.load(path, map_location=map_location, weights_only=False, **options)
        with torch.serialization.safe_globals(allowed_types()):
            return torch.load(path, map_location=map_location, weights_only=True, **options)
    except pickle.UnpicklingError as err:  # what torch raises when the restricted unpickler refuses
        if allow_pickle:
            raise _unreadable(label, err) from None
        raise UnsafeCheckpointFile(_refusal(path, label, err)) from None
    except _PARSE_ERRORS as err:
        raise _unreadable(label, err) from None


def _unreadable(label: str | os.PathLike, err: BaseException) -> UnreadableCheckpointFile:
    return UnreadableCheckpointFile(
        f"{label}: cannot be read as a torch checkpoint file ({type(err).__name__}: {_first_line(err)}); it is "
        "damaged or was not written by torch.save. `lazyzero ckpt verify` compares a lazyzero checkpoint with its "
        "manifest; load another tag, or restore this file from a copy")


def is_zip_format(source: str | os.PathLike | BinaryIO) -> bool:
    """Whether the file is in torch.save's zip format (the only one torch can memory-map)."""
    if hasattr(source, "read"):
        position = source.tell()
        head = source.read(len(ZIP_MAGIC))
        source.seek(position)
        return head == ZIP_MAGIC
    with open(source, "rb") as f:
        return f.read(len(ZIP_MAGIC)) == ZIP_MAGIC


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"


def _refusal(source: str | os.PathLike | BinaryIO, path: str | os.PathLike, err: pickle.UnpicklingError) -> str:
    if hasattr(source, "seek"):
        source.seek(0)
    unsafe = _unsafe_globals(source) or _globals_named_in(err)
    if unsafe:
        why = f"that holds {', '.join(unsafe)}: loading it would run code it names"
    else:
        why = (f"that the restricted unpickler refuses ({_unpickler_reason(err)}): it is damaged, or holds an "
               "object that is not a tensor, container or number")
    return (f"{path}: refusing to load a checkpoint file {why}. lazyzero loads only tensors, containers, numbers "
            f"and {', '.join(ALLOWED_GLOBALS)}. If you trust this folder, set {OPT_OUT_KEY}: true")


def _globals_named_in(err: pickle.UnpicklingError) -> list[str]:
    """The globals torch's refusal names (get_unsafe_globals_in_checkpoint reads zip files only)."""
    return sorted(set(re.findall(r"GLOBAL ([\w.]+)", str(err))))


def _unpickler_reason(err: pickle.UnpicklingError) -> str:
    """torch's own reason, without its advice to load with weights_only=False."""
    match = re.search(r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|$)", str(err), re.S)
    return " ".join(match.group(1).split()) if match else "the restricted unpickler refused it"


def _unsafe_globals(path: str | os.PathLike | BinaryIO) -> list[str]:
    """The file's globals that are neither torch's defaults nor allowlisted (empty when unreadable)."""
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in allowed_types()}
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # a damaged file: the load's own error was about that, the refusal says what it can
        return []
    return [name for name in found if name not in allowed]
