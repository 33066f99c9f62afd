"""Stored activations of chosen layers moved off the device during the forward and read back ahead of
their backward (docs/plan.md: "activation offload to host or NVMe with prefetch").

The memory planner (lazyzero/plan/solver/problem.py) may give a layer's saved activations a home on
another tier, host memory (CUDA) or NVMe. Its model: the layer's stored forms are written out from
its own forward window on and come back during the backward of later layers, before the layer's own
backward, so that the copies overlap compute. `ActivationOffloader` runs that schedule:

- **Out.** The packer (packing.py) hands over each stored form of an offloaded layer as soon as it is
  stored: block-quantized codes and scales (`offload_packed`), or a storage kept as saved
  (`offload_kept`). Its bytes go to a staging buffer (on a CUDA device: an asynchronous copy on a side
  stream into pinned memory; on the host: a memcpy, small next to the layer's compute), autograd keeps
  an `OffloadedStorage` instead, and the original is freed as soon as the forward drops it. NVMe: a
  worker thread writes the staging buffer to a file, then frees it (or keeps it for reuse on CUDA;
  offload_io.py).
- **Back.** When layer j's backward starts (a hook on the gradient of its output), the forms of layer j
  and of the `offload_prefetch_layers` layers below it are requested, so that those of j-1, ... arrive
  while layer j's backward computes. An unpack that finds its form not back yet requests it (if no
  one has) and waits: those waits and their seconds are the exposed transfer time the planner
  predicts (`ActivationAccounting.offload_waits` / `offload_wait_s`). On CUDA the wait for a host
  copy happens on the GPU stream, so it is counted but its seconds are not measured.
- **Errors** of a background write or read are raised by the unpack that needs the tensor, naming the
  file; one that no unpack met is raised by `check()` (the next forward, the engine's step metrics)
  or `close()`. One error is raised per burst: those recorded until then count as reported with it.
- **Files**: one per stored form, in a folder of this rank and process under `offload_nvme_path`,
  deleted once read back or once autograd drops the form unread; `close()` removes the folder, and so
  does interpreter exit when close was never called.

Forms under MIN_OFFLOAD_BYTES stay where they are (a file and a transfer would cost more than they
free), and so does everything of a "cpu" layer whose tensors already live in host memory (a machine
without CUDA). The CUDA paths (side-stream copies, the pinned "cpu" tier) have not run on a GPU yet;
tests/activations/test_offload.py runs the NVMe path on CPU.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn

from lazyzero.activations.config import ActivationsConfig
from lazyzero.activations.offload_io import AioSettings, FileTransfer, NvmeStore, round_up
from lazyzero.activations.policy import KEEP_BITS, decoder_layers
from lazyzero.ops.quant import BlockQuantized, dequantize_blockwise

Tier = Literal["cpu", "nvme"]
MIN_OFFLOAD_BYTES = 4096
READERS = ("ahead", "own", "unpack")  # who asked for a read: a later layer's backward, its own, the unpack
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackedLayout:
    """A BlockQuantized as bytes: codes from byte 0, fp32 scales from `scales_offset`, then, when it
    keeps block outliers, their values (in the tensor's dtype) and one-byte indices (one of each per block)."""

    codes_dtype: torch.dtype
    codes_numel: int
    scales_numel: int
    bits: int
    block_size: int
    shape: torch.Size
    dtype: torch.dtype
    keeps_outliers: bool = False

    @classmethod
    def of(cls, packed: BlockQuantized) -> PackedLayout:
        return cls(packed.codes.dtype, packed.codes.numel(), packed.scales.numel(), packed.bits,
                   packed.block_size, packed.shape, packed.dtype, packed.outlier_values is not None)

    @property
    def scales_offset(self) -> int:
        return round_up(self.codes_numel * self.codes_dtype.itemsize, 4)  # fp32 views need 4-byte starts

    @property
    def values_offset(self) -> int:
        return self.scales_offset + 4 * self.scales_numel

    @property
    def index_offset(self) -> int:
        return self.values_offset + self.dtype.itemsize * self.scales_numel

    @property
    def payload_bytes(self) -> int:
        return self.index_offset + self.scales_numel if self.keeps_outliers else self.values_offset

    def parts(self, packed: BlockQuantized) -> list[tuple[int, torch.Tensor]]:
        parts = [(0, packed.codes), (self.scales_offset, packed.scales)]
        if self.keeps_outliers:
            parts += [(self.values_offset, packed.outlier_values), (self.index_offset, packed.outlier_index)]
        return parts

    def restore(self, data: torch.Tensor) -> torch.Tensor:
        codes = data[: self.codes_numel * self.codes_dtype.itemsize].view(self.codes_dtype)
        scales = data[self.scales_offset: self.values_offset].view(torch.float32)
        values = index = None
        if self.keeps_outliers:
            values = data[self.values_offset: self.index_offset].view(self.dtype)
            index = data[self.index_offset: self.payload_bytes]
        packed = BlockQuantized(codes, scales, self.bits, self.block_size, self.shape, self.dtype, values, index)
        return dequantize_blockwise(packed).reshape(-1)


@dataclass(frozen=True)
class KeptLayout:
    """A storage kept as saved: `numel` elements of `dtype`."""

    dtype: torch.dtype
    numel: int
    bits = KEEP_BITS

    @property
    def payload_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def restore(self, data: torch.Tensor) -> torch.Tensor:
        # A buffer of its own (PackedView's contract: its caller may overwrite it), as a dequantized form is.
        return data[: self.payload_bytes].view(self.dtype).clone()


@dataclass(frozen=True, eq=False)
class OffloadedStorage:
    """The stored form a PackedView holds while it lives off the device; `materialize` brings it back."""

    offloader: ActivationOffloader
    transfer: FileTransfer | HostTransfer
    layout: PackedLayout | KeptLayout
    device: torch.device

    @property
    def bits(self) -> int:
        return self.layout.bits

    def materialize(self) -> torch.Tensor:
        return self.layout.restore(self.offloader.fetch(self))


class HostTransfer:
    """A stored form's copy in pinned host memory (CUDA "cpu" tier) and its way back to the device."""

    def __init__(self, host: torch.Tensor, payload_bytes: int, layer: int, device: torch.device,
                 copied: torch.cuda.Event):
        self.host, self.payload_bytes, self.layer, self.device, self.copied = host, payload_bytes, layer, device, copied
        self.device_data: torch.Tensor | None = None
        self.back: torch.cuda.Event | None = None
        self.error: Exception | None = None
        self.read_by: str | None = None
        self.discarded = self.closed = self.reported = False

    def close(self) -> None:
        self.closed, self.host, self.device_data = True, None, None


class _ForwardPass:
    """The transfers of one forward pass by layer, for the prefetch of its backward."""

    def __init__(self) -> None:
        self.by_layer: dict[int, list] = defaultdict(list)


class ActivationOffloader:
    """Moves the stored forms of `config.offload_layers` off the device and back (module docstring).

    `recording()` says whether saved tensors are being recorded now (the packer's `active`); waits
    are counted in `accounting`. `rank` names this rank's folder (default: torch.distributed's rank);
    `aio`: the NVMe handle's settings (default: DeepSpeed's).
    """

    def __init__(self, model: nn.Module, config: ActivationsConfig, accounting, recording: Callable[[], bool], *,
                 rank: int | None = None, aio: AioSettings | None = None):
        self.tiers: dict[int, Tier] = dict(config.offload_layers)
        self.prefetch_layers = config.offload_prefetch_layers
        self.accounting, self._recording = accounting, recording
        layers = decoder_layers(model)
        _check_layers(self.tiers, layers, config.recompute_layers)
        self._lock = threading.Lock()
        self._errors: list = []
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._pass: _ForwardPass | None = None
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._closed = False
        self._held = 0  # forms offloaded and not dropped by autograd yet
        self.reads = dict.fromkeys(READERS, 0)
        self._nvme = None
        if "nvme" in self.tiers.values():
            self._nvme = NvmeStore(config.offload_nvme_path, _rank(rank), aio or AioSettings(), self._background_error,
                                   pinned=torch.cuda.is_available())
        self._finalizer = weakref.finalize(self, _shutdown, self._nvme, self._live)
        self._handles = [module.register_forward_hook(functools.partial(self._after_layer_forward, index))
                         for index, module in layers.items() if self._reads_at_backward_of(index)]
        host_only = sorted(layer for layer, tier in self.tiers.items() if tier == "cpu")
        if host_only and not torch.cuda.is_available():
            _log.warning("lazyzero.activations.offload_layers: layers %s say 'cpu', but without CUDA their activations "
                         "already live in host memory and stay there", host_only)

    # --- out: called by the packer right after it stores a form -----------------------------------

    def offload_packed(self, packed: BlockQuantized, layer: int | None) -> OffloadedStorage | None:
        """`packed` moved off the device if its layer offloads (None: keep it as it is)."""
        layout = PackedLayout.of(packed)
        return self._offload(layout, layout.parts(packed), layer, packed.codes.device)

    def offload_kept(self, root: torch.Tensor, layer: int | None) -> OffloadedStorage | None:
        """`root`'s whole storage, kept as saved, moved off the device if its layer offloads (None: keep it)."""
        numel = root.untyped_storage().nbytes() // root.element_size()
        flat = root.detach().as_strided((numel,), (1,), 0)
        return self._offload(KeptLayout(root.dtype, numel), [(0, flat)], layer, root.device)

    def _offload(self, layout, parts, layer: int | None, device: torch.device) -> OffloadedStorage | None:
        tier = self.tiers.get(layer)
        if tier is None or self._closed or layout.payload_bytes < MIN_OFFLOAD_BYTES:
            return None
        if tier == "cpu" and device.type == "cpu":
            return None
        if tier == "nvme":
            pool, payload = self._nvme.pool, layout.payload_bytes
            staging = pool.take(payload)
            transfer = FileTransfer(self._nvme.new_path(layer), payload, pool.io_bytes(payload), layer, staging,
                                    self._copy_parts(staging, parts, device))
            self._nvme.worker.write(transfer)
        else:
            host = torch.empty(layout.payload_bytes, dtype=torch.uint8, pin_memory=True)
            transfer = HostTransfer(host, layout.payload_bytes, layer, device, self._copy_parts(host, parts, device))
        self._live.add(transfer)
        with self._lock:
            self._held += 1
        if self._pass is not None:
            self._pass.by_layer[layer].append(transfer)
        storage = OffloadedStorage(self, transfer, layout, device)
        weakref.finalize(storage, self._forget, transfer).atexit = False
        return storage

    def _copy_parts(self, destination: torch.Tensor, parts, device: torch.device) -> torch.cuda.Event | None:
        """The parts' bytes into `destination`: now on the host; on a side stream from a CUDA device
        (the returned event marks the end; the sources stay allocated until then by `record_stream`)."""
        if device.type == "cpu":
            for offset, tensor in parts:
                destination[offset: offset + tensor.nbytes].copy_(_bytes_of(tensor))
            return None
        stream = self._side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for offset, tensor in parts:
                destination[offset: offset + tensor.nbytes].copy_(_bytes_of(tensor), non_blocking=True)
                tensor.record_stream(stream)
            copied = torch.cuda.Event()
            copied.record(stream)
        return copied

    # --- back: prefetch at a layer's backward, and the unpack --------------------------------------

    def begin_forward(self) -> None:
        """A new forward pass (the packer's outermost `with`): its transfers are grouped apart."""
        self.check()
        self._pass = _ForwardPass()

    def end_forward(self) -> None:
        """The forward pass ended: once its writes are done, the staging buffers they leave idle are
        freed (kept until its backward, they would hold the very memory the offload freed)."""
        if self._nvme is not None and not self._closed:
            self._nvme.worker.trim()

    def _reads_at_backward_of(self, index: int) -> bool:
        reach = range(index - self.prefetch_layers, index + 1)
        return self.prefetch_layers > 0 and any(layer in self.tiers for layer in reach)

    def _after_layer_forward(self, index: int, module, args, output) -> None:
        if not self._recording() or self._pass is None:
            return
        tensor = _first_tensor_needing_grad(output)
        if tensor is not None:
            tensor.register_hook(functools.partial(self._layer_backward_starts, self._pass, index))

    def _layer_backward_starts(self, forward_pass: _ForwardPass, index: int, grad) -> None:
        # The layer's own forms first (needed now), then those below it; within a layer the last
        # saved first, as its backward unpacks them.
        for layer in range(index, index - self.prefetch_layers - 1, -1):
            for transfer in reversed(forward_pass.by_layer.get(layer, ())):
                self._request_read(transfer, "own" if layer == index else "ahead")

    def _request_read(self, transfer, reader: str) -> None:
        with self._lock:
            if transfer.read_by is not None or transfer.discarded or transfer.closed or transfer.error is not None:
                return
            transfer.read_by = reader
            self.reads[reader] += 1
        if isinstance(transfer, FileTransfer):
            self._nvme.worker.read(transfer)
        else:
            self._host_to_device(transfer)

    def fetch(self, storage: OffloadedStorage) -> torch.Tensor:
        """The stored form's bytes, back on its device; waits (and counts the wait) if not back yet."""
        transfer = storage.transfer
        if transfer.closed:
            raise RuntimeError(f"activation offload: a stored form of layer {transfer.layer} was needed after the "
                               "offloader was closed (close() ends training; backward must run before it)")
        self._request_read(transfer, "unpack")
        if isinstance(transfer, HostTransfer):
            return self._host_data(transfer, storage.device)
        if not transfer.back.is_set():
            start = time.perf_counter()
            transfer.back.wait()
            self.accounting.record_wait(time.perf_counter() - start)
        if transfer.error is not None:
            self._raise(transfer)
        if storage.device.type == "cpu":
            return transfer.data
        return self._file_data_on_device(transfer, storage.device)

    def _file_data_on_device(self, transfer: FileTransfer, device: torch.device) -> torch.Tensor:
        """CUDA: copy the bytes read from the file to the device once; the host buffer goes back to the
        pool once that copy is done (the worker waits for its event)."""
        if transfer.device_data is None:
            transfer.device_data = transfer.data[: transfer.payload_bytes].to(device, non_blocking=True)
            transfer.copied = torch.cuda.Event()
            transfer.copied.record(torch.cuda.current_stream(device))
            self._nvme.worker.discard(transfer)
        return transfer.device_data

    def _host_to_device(self, transfer: HostTransfer) -> None:
        stream = self._side_stream(transfer.device)
        with torch.cuda.stream(stream):
            stream.wait_event(transfer.copied)
            transfer.device_data = transfer.host.to(transfer.device, non_blocking=True)
            transfer.back = torch.cuda.Event()
            transfer.back.record(stream)

    def _host_data(self, transfer: HostTransfer, device: torch.device) -> torch.Tensor:
        if not transfer.back.query():
            self.accounting.record_wait(0.0)  # the stream waits on the GPU; seconds not measured here
        current = torch.cuda.current_stream(device)
        current.wait_event(transfer.back)
        transfer.device_data.record_stream(current)
        return transfer.device_data

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # --- life and errors ---------------------------------------------------------------------------

    def _forget(self, transfer) -> None:
        """Autograd dropped the form (used, or never needed): its file and buffers go."""
        if transfer.closed:
            return
        transfer.discarded = True
        with self._lock:
            self._held -= 1
            everything_consumed = self._held == 0
        if isinstance(transfer, FileTransfer):
            self._nvme.worker.discard(transfer)
            if everything_consumed:  # the backward is over: free the read buffers left idle
                self._nvme.worker.trim()
        else:
            transfer.close()

    def _background_error(self, transfer: FileTransfer) -> None:
        with self._lock:
            self._errors.append(transfer)

    def check(self) -> None:
        """Raise the first background error not raised yet (its form was dropped unread, or not unpacked yet)."""
        with self._lock:
            pending = [transfer for transfer in self._errors if not transfer.reported]
        if pending:
            self._raise(pending[0])

    def _raise(self, transfer) -> None:
        # One error per failure burst: those recorded so far count as reported with it (the step
        # fails on this one; a disk that fails one write usually fails the next few too).
        with self._lock:
            for failed in self._errors:
                failed.reported = True
            self._errors.clear()
        transfer.reported = True
        raise transfer.error

    def take_io_stats(self) -> dict:
        """Since the last call: NVMe bytes written and read, the worker's seconds in those transfers,
        the most host memory its aligned buffers took at once (`buffer_peak_bytes`), and who asked
        for the reads (`reads_ahead`, `reads_own`, `reads_unpack`)."""
        with self._lock:
            reads, self.reads = self.reads, dict.fromkeys(READERS, 0)
        io = {}
        if self._nvme is not None:
            io = {**self._nvme.worker.take_stats(), "buffer_peak_bytes": self._nvme.pool.take_peak_bytes()}
        return {**io, **{f"reads_{reader}": count for reader, count in reads.items()}}

    def flush(self) -> None:
        """Block until every NVMe write and read asked so far is done (the forward's writes, say)."""
        if self._nvme is not None and not self._closed:
            self._nvme.worker.flush()

    def remove(self) -> None:
        """Unregister the layer hooks (transfers already made still come back)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def close(self) -> None:
        """Finish the transfers in flight, delete every file and the folder, free the buffers; then
        raise a background error that no unpack raised. Stored forms still held fail if unpacked later."""
        if self._closed:
            return
        self.remove()
        self._closed = True
        self._finalizer()
        self.check()


def _shutdown(nvme: NvmeStore | None, live: weakref.WeakSet) -> None:
    """close()'s work, also run at exit when close was never called (holds no reference to the offloader).
    The worker finishes first; then no transfer may touch a buffer, and the pool frees them all."""
    if nvme is not None:
        nvme.worker.close()
    for transfer in list(live):
        transfer.close()
    if nvme is not None:
        nvme.close()


def _check_layers(tiers: dict[int, Tier], layers: dict[int, nn.Module], recomputed: list[int]) -> None:
    missing = sorted(set(tiers) - set(layers))
    if missing:
        raise ValueError(f"lazyzero.activations.offload_layers: no decoder layer {missing}; "
                         f"the model has layers 0 to {max(layers, default=-1)}")
    both = sorted(set(tiers) & set(recomputed))
    if both:
        raise ValueError(f"lazyzero.activations.offload_layers: layers {both} are recomputed too "
                         "(recompute_layers); a recomputed layer keeps only its input, for the recompute")


def _rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _first_tensor_needing_grad(output) -> torch.Tensor | None:
    """The layer's hidden-state output: the tensor itself, or the first of a tuple (GPT-2's blocks)."""
    candidates = output if isinstance(output, (tuple, list)) else (output,)
    for candidate in candidates:
        if isinstance(candidate, torch.Tensor) and candidate.requires_grad:
            return candidate
    return None
