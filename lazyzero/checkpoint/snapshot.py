"""Snapshots: the state DeepSpeed hands to `save`, taken while it cannot change.

`save` only records what to do (one `FileSnapshot` per file DeepSpeed writes). The state is
immutable until the next optimizer step (DataStates-LLM), so in the background, while the next
forward and backward run, and before that step:
- a host tensor that is a whole storage of its own is serialized straight from training's memory
  (`FileSnapshot.live`): torch.save's bytes are copied into the writer's staging blocks
  (staged_io.py), and that copy is the snapshot, with no per-tensor host buffer and no second copy
  (on a CPU-only run, every core a copy takes is training's);
- a device tensor is copied into a reused host buffer (pinned; on a side stream), and so is a host
  tensor that is a view of a larger storage (torch.save would write the whole storage), so that
  the file holds exactly each tensor's bytes, as DeepSpeed's own save (which clones them) does.
Files holding only buffers are written after the step, at leisure. Non-tensor leaves are deep-copied
at once: they are small and some (param_groups) change at the step.
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyzero.checkpoint.background_pace import BackgroundPace, paced_copy

COPY_PIECE_BYTES = 4 << 20  # a paced copy's piece: long enough that admitting it costs nothing


class HostBufferLimitError(RuntimeError):
    """The snapshot buffers would exceed `lazyzero.checkpoint.host_buffer_limit`."""


@dataclass
class FileSnapshot:
    """One file of a checkpoint. `state` (a torch.save-able object whose tensors are host buffers)
    or `raw_source` (a file copied byte for byte, such as NVMe swap files) into `raw`."""

    relpath: str
    state: Any = None
    raw_source: str | None = None
    raw: torch.Tensor | None = None
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (host buffer, live tensor)
    live: list[torch.Tensor] = field(default_factory=list)  # host tensors written from training's memory

    @property
    def nbytes(self) -> int:
        if self.raw is not None:
            return self.raw.numel()
        return sum(dst.numel() * dst.element_size() for dst, _ in self.copies) + self.live_nbytes

    @property
    def live_nbytes(self) -> int:
        """Bytes serialized straight from training's memory, through no host buffer."""
        return sum(t.numel() * t.element_size() for t in self.live)

    @property
    def reads_live_state(self) -> bool:
        """True when writing the file reads training's memory: it must be written before the next step."""
        return bool(self.live)


class HostBuffers:
    """Host tensors reused from one snapshot to the next, by (file, position in the state).

    One instance per in-flight slot; all slots share `limit_bytes` through `BufferBudget`. Buffers are
    separate allocations (not views of one pool) so that torch.save writes exactly each tensor's bytes.
    """

    def __init__(self, budget: "BufferBudget", pin: bool):
        self._budget = budget
        self._pin = pin
        self._by_key: dict[tuple, torch.Tensor] = {}

    def get(self, key: tuple, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buffer = self._by_key.get(key)
        if buffer is not None and buffer.shape == shape and buffer.dtype == dtype:
            return buffer
        if buffer is not None:
            self._budget.release(buffer.numel() * buffer.element_size())
        nbytes = shape.numel() * dtype.itemsize
        self._budget.reserve(nbytes)
        buffer = torch.empty(shape, dtype=dtype, pin_memory=self._pin)
        self._by_key[key] = buffer
        return buffer


def snapshot_host_bytes(copied_bytes: int, written_bytes: int, files: int, block_bytes: int,
                        limit_bytes: int | None = None, max_in_flight: int = 1) -> int:
    """The most host memory a lazy checkpoint's snapshot holds, from its first save on (docs/checkpoint.md,
    "Memory"): per in-flight checkpoint, a `HostBuffers` buffer for every copied byte (device tensors,
    views, NVMe swap files) and, since a copy outpaces the disk, a staging block for every byte the
    files hold (`written_bytes`, copied ones included) plus one partly filled block per file; all of
    it at most `limit_bytes` (`BufferBudget`). Both are kept for the next checkpoint, never freed."""
    held = max_in_flight * (copied_bytes + written_bytes + files * block_bytes)
    return held if limit_bytes is None else min(held, limit_bytes)


class BufferBudget:
    """Host bytes held by snapshot buffers, against the configured limit (None: no limit)."""

    def __init__(self, limit_bytes: int | None):
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> None:
        with self._lock:
            if self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes:
                raise HostBufferLimitError(
                    f"lazyzero.checkpoint.host_buffer_limit: {self.limit_bytes} bytes; snapshot buffers need at least "
                    f"{self.used_bytes + nbytes} bytes on this rank (one snapshot per in-flight checkpoint, "
                    f"lazyzero.checkpoint.max_in_flight); raise the limit, lower max_in_flight, or set it to null")
            self.used_bytes += nbytes

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` if the limit allows; False (nothing reserved) otherwise."""
        try:
            self.reserve(nbytes)
        except HostBufferLimitError:
            return False
        return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used_bytes -= nbytes


def snapshot_state(relpath: str, state: Any, buffers: HostBuffers) -> FileSnapshot:
    """A FileSnapshot of `state` whose tensors are host buffers still to be filled by `copies`."""
    snap = FileSnapshot(relpath)
    aliases: dict[tuple, torch.Tensor] = {}

    def swap(value: Any, key: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            return _buffer_for(value, key)
        if isinstance(value, dict):
            swapped = {k: swap(v, key + (k,)) for k, v in value.items()}
            if type(value) is dict:
                return swapped
            # Module state dicts are OrderedDicts whose `_metadata` carries per-module versions.
            ordered = OrderedDict(swapped)
            if hasattr(value, "_metadata"):
                ordered._metadata = copy.deepcopy(value._metadata)
            return ordered
        if isinstance(value, list):
            return [swap(v, key + (i,)) for i, v in enumerate(value)]
        if type(value) is tuple:  # not torch.Size or named tuples: deep-copied as they are below
            return tuple(swap(v, key + (i,)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    def _buffer_for(tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.numel() == 0:
            return tensor.to("cpu", copy=True)
        alias_key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)
        if alias_key in aliases:  # tied weights: one copy, saved once, loaded into both
            return aliases[alias_key]
        if is_whole_host_storage(tensor):
            snap.live.append(tensor)
            aliases[alias_key] = tensor
            return tensor
        buffer = buffers.get((relpath,) + key, tensor.shape, tensor.dtype)
        snap.copies.append((buffer, tensor))
        aliases[alias_key] = buffer
        return buffer

    snap.state = swap(state, ())
    return snap


def is_whole_host_storage(tensor: torch.Tensor) -> bool:
    """A host tensor that torch.save writes as exactly its own bytes: contiguous, the whole of its storage."""
    return (tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def snapshot_file(relpath: str, source: str | os.PathLike, buffers: HostBuffers) -> FileSnapshot:
    """A FileSnapshot of a file on disk (NVMe-resident optimizer state), read later by `run_copies`."""
    size = os.path.getsize(source)
    return FileSnapshot(relpath, raw_source=str(source),
                        raw=buffers.get((relpath, "raw"), torch.Size([size]), torch.uint8))


def run_copies(files: list[FileSnapshot], pace: BackgroundPace | None = None) -> None:
    """Fill the host buffers of `files` from host tensors and files (blocking; on the copy thread),
    in pieces `pace` admits. Device tensors are copied by the side stream instead (`start_device_copies`)."""
    for snap in files:
        for dst, src in snap.copies:
            if not src.is_cuda:
                paced_copy(dst, src, pace, COPY_PIECE_BYTES)
        if snap.raw_source is not None:
            _read_into(snap.raw_source, snap.raw, pace)


def _read_into(path: str, buffer: torch.Tensor, pace: BackgroundPace | None) -> None:
    view = memoryview(buffer.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < view.nbytes:
            piece = view[done:done + COPY_PIECE_BYTES]
            if pace is not None:
                pace.admit(piece.nbytes)
            n = f.readinto(piece)
            if not n:
                raise OSError(f"{path}: shrank to {done} bytes while being copied (expected {view.nbytes})")
            done += n


def start_device_copies(files: list[FileSnapshot], stream) -> None:
    """Queue the device-to-host copies of `files` on `stream` (CUDA), after the work already queued
    on the current stream (the step that produced the state); returns at once."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for snap in files:
            for dst, src in snap.copies:
                if src.is_cuda:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)  # the caching allocator must not reuse it before the copy
