"""The NVMe side of the activation offload: DeepSpeed's async I/O handle, driven by one background
thread, and a pool of aligned buffers (lazyzero/activations/offload.py decides what goes where).

DeepSpeed's aio op (`deepspeed/ops/csrc/aio`, the one `deepspeed/runtime/swap_tensor/` uses) opens
files with O_DIRECT: buffer address, length and file offset must be multiples of the handle's
alignment (times `intra_op_parallelism`, which splits each operation). A buffer that is neither
torch-pinned nor page-locked by DeepSpeed's pinned-tensor manager gets a bounce buffer allocated per
operation, so every transfer goes through a `BufferPool` buffer: reused on CUDA, where pinning is slow
(the sizes repeat from layer to layer and step to step); allocated per transfer and freed once done
on a machine without CUDA, where the host memory a buffer holds is what the offload is freeing.

Facts about the handle (DeepSpeed 0.19.8) that shape `NvmeWorker`:
- `wait()` waits for every operation submitted so far and returns only their count, so each batch
  holds operations whose completion may be reported together (one layer's reads; consecutive writes);
- a failed open makes `async_pwrite` / `async_pread` return -1 (DeepSpeed prints the errno), and an
  error inside a transfer is not reported at all: the worker checks the return code and the file's
  size after a write; before a read it checks the size itself (the handle asserts on a short file);
- `wait()` holds the handle's mutex, which `new_cpu_locked_tensor` takes too: buffers come from a
  second handle, so that the compute thread never waits behind the disk for an allocation.
"""

from __future__ import annotations

import itertools
import os
import queue
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

# DeepSpeed's defaults (deepspeed/runtime/swap_tensor/constants.py), used when no "aio" section is given.
AIO_DEFAULTS = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True}
# Operations submitted before one wait(): the handle's queue depth bounds what runs at once anyway.
MAX_BATCH = 32
_STOP = ("stop", None)
_NO_STATS = {"written_bytes": 0, "write_s": 0.0, "read_bytes": 0, "read_s": 0.0}


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class AioSettings:
    """The aio handle's constructor arguments (keys of DeepSpeed's "aio" section)."""

    block_size: int = AIO_DEFAULTS["block_size"]
    queue_depth: int = AIO_DEFAULTS["queue_depth"]
    intra_op_parallelism: int = AIO_DEFAULTS["intra_op_parallelism"]
    single_submit: bool = AIO_DEFAULTS["single_submit"]
    overlap_events: bool = AIO_DEFAULTS["overlap_events"]

    @classmethod
    def from_deepspeed(cls, aio_config: dict | None) -> AioSettings:
        """From DeepSpeed's parsed "aio" section (`DeepSpeedConfig.aio_config`); unknown keys (use_gds) ignored."""
        given = aio_config or {}
        return cls(**{key: given.get(key, default) for key, default in AIO_DEFAULTS.items()})

    def new_handle(self, aio_op):
        return aio_op.aio_handle(self.block_size, self.queue_depth, self.single_submit, self.overlap_events,
                                 self.intra_op_parallelism)


def load_aio_op():
    """DeepSpeed's async_io op (JIT-built on first use), or a RuntimeError saying why it cannot be."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError("lazyzero.activations.offload_layers: 'nvme' needs DeepSpeed's async_io op, which cannot "
                           "be built here (install libaio-dev; see `ds_report`)")
    return builder.load(verbose=False)


class BufferPool:
    """Aligned byte buffers, reused: `take` one of at least n bytes, `give` it back, `trim` the idle ones.

    A buffer is reused for a request of at most its size and more than half of it (the shapes of the
    layers repeat, so most requests find an exact fit). Idle buffers are host memory like any other:
    at most `max_idle_bytes` of them are kept (None: no bound), and the offloader trims them once a
    forward's writes are done and once a backward has read everything back.
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor], release: Callable[[torch.Tensor], None], granule: int,
                 max_idle_bytes: int | None = None):
        self._allocate, self._release, self.granule = allocate, release, granule
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[torch.Tensor] = []
        self._owned: dict[int, torch.Tensor] = {}  # every buffer allocated and not freed, by id
        self._allocated = self._peak = 0
        self._lock = threading.Lock()

    def io_bytes(self, nbytes: int) -> int:
        """`nbytes` rounded up to the granule: what a transfer of them reads or writes."""
        return round_up(max(nbytes, 1), self.granule)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least `io_bytes(nbytes)` bytes (maybe more: slice it for I/O; give back the buffer itself)."""
        size = self.io_bytes(nbytes)
        with self._lock:
            fits = [index for index, buffer in enumerate(self._idle) if size <= buffer.numel() < 2 * size]
            if fits:
                return self._idle.pop(min(fits, key=lambda index: self._idle[index].numel()))
        buffer = self._allocate(size)
        with self._lock:
            self._owned[id(buffer)] = buffer
            self._allocated += size
            self._peak = max(self._peak, self._allocated)
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            idle_bytes = sum(idle.numel() for idle in self._idle) + buffer.numel()
            if self.max_idle_bytes is None or idle_bytes <= self.max_idle_bytes:
                self._idle.append(buffer)
                return
        self._free([buffer])

    def trim(self) -> None:
        """Free the idle buffers."""
        with self._lock:
            idle, self._idle = self._idle, []
        self._free(idle)

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the buffers allocated now, in use or idle."""
        with self._lock:
            return self._allocated

    def take_peak_bytes(self) -> int:
        """The most bytes allocated at once (in use or idle) since the last call."""
        with self._lock:
            peak, self._peak = self._peak, self._allocated
        return peak

    def close(self) -> None:
        """Free every buffer, given back or not: nothing may use one afterwards."""
        with self._lock:
            owned, self._idle = list(self._owned.values()), []
        self._free(owned)

    def _free(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                del self._owned[id(buffer)]
                self._allocated -= buffer.numel()
        for buffer in buffers:
            self._release(buffer)


def locked_buffer_pool(alloc_handle, alignment: int) -> BufferPool:
    """Host buffers page-locked by DeepSpeed's pinned-tensor manager (what its aio reads and writes
    without a bounce buffer); page-aligned, so any alignment up to a page holds.

    For a machine without CUDA, where host memory is the very tier the offload frees: no buffer is
    kept idle (allocating and locking measured 0.2-0.3 ms per MB here, next to seconds of compute
    per layer; an idle buffer would hold what its write just freed until the next reuse).
    """
    example = torch.empty(0, dtype=torch.uint8)

    def allocate(size: int) -> torch.Tensor:
        _count_locked(size)
        return alloc_handle.new_cpu_locked_tensor(size, example)

    def release(buffer: torch.Tensor) -> None:
        alloc_handle.free_cpu_locked_tensor(buffer)
        _count_locked(-buffer.numel())

    return BufferPool(allocate, release, alignment, max_idle_bytes=0)


def pinned_buffer_pool(alignment: int) -> BufferPool:
    """CUDA-pinned host buffers (device copies run asynchronously from them), aligned for O_DIRECT;
    reused without bound between trims (pinning is slow, and host memory is not the device's)."""

    def allocate(size: int) -> torch.Tensor:
        raw = torch.empty(size + alignment, dtype=torch.uint8, pin_memory=True)
        start = (-raw.data_ptr()) % alignment
        return raw.narrow(0, start, size)

    return BufferPool(allocate, lambda buffer: None, alignment)


_CAP_IPC_LOCK = 1 << 14
_locked = {"bytes": 0}  # locked by this module's pools, in this process
_locked_lock = threading.Lock()


def _count_locked(change: int) -> None:
    """Count `change` more locked bytes. DeepSpeed's allocator asserts (or crashes) when mlock fails:
    fail first, with the reason, when the process may not lock that much."""
    with _locked_lock:
        wanted = _locked["bytes"] + change
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if change > 0 and soft != resource.RLIM_INFINITY and wanted > soft and not _has_ipc_lock():
            raise RuntimeError(f"activation offload: {wanted} bytes of page-locked buffers would exceed this "
                               f"process's locked-memory limit of {soft} bytes (raise `ulimit -l`)")
        _locked["bytes"] = wanted


def _has_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & _CAP_IPC_LOCK)
    except OSError:
        pass
    return False


class FileTransfer:
    """One stored form's trip to its file and back. The worker sets `error` or `data`, then `back`."""

    def __init__(self, path: str, payload_bytes: int, io_bytes: int, layer: int, staging: torch.Tensor,
                 copied: torch.cuda.Event | None = None):
        self.path = path
        self.payload_bytes = payload_bytes
        self.io_bytes = io_bytes  # payload rounded up to the aio alignment: the file's size
        self.layer = layer
        self.staging: torch.Tensor | None = staging  # the bytes to write, until written
        self.copied = copied  # set once a device-to-host copy into `staging` is done (CUDA only)
        self.data: torch.Tensor | None = None  # the bytes read back
        self.device_data: torch.Tensor | None = None  # those bytes copied to a CUDA device (offload.py)
        self.error: OSError | None = None
        self.back = threading.Event()
        self.read_by: str | None = None  # who asked for the read (offload.py: ahead, own, unpack)
        self.discarded = self.closed = self.reported = self.on_disk = False

    def close(self) -> None:
        """The offloader closed: forget every buffer (the pool frees them next)."""
        self.closed, self.staging, self.data, self.device_data = True, None, None, None


class NvmeWorker:
    """A thread that writes and reads `FileTransfer`s with one aio handle, in the order asked."""

    def __init__(self, io_handle, pool: BufferPool, on_error: Callable[[FileTransfer], None]):
        self._handle, self._pool, self._on_error = io_handle, pool, on_error
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stats_lock = threading.Lock()
        self._stats = dict(_NO_STATS)
        self._thread = threading.Thread(target=self._run, name="lazyzero-activation-nvme", daemon=True)
        self._thread.start()

    def take_stats(self) -> dict:
        """Bytes written and read, and seconds from submitting each batch to its completion, since the last call."""
        with self._stats_lock:
            stats, self._stats = self._stats, dict(_NO_STATS)
        return stats

    def write(self, transfer: FileTransfer) -> None:
        self._jobs.put(("write", transfer))

    def read(self, transfer: FileTransfer) -> None:
        self._jobs.put(("read", transfer))

    def discard(self, transfer: FileTransfer) -> None:
        """Drop the transfer's file and buffers once what was asked before is done."""
        self._jobs.put(("discard", transfer))

    def trim(self) -> None:
        """Free the pool's idle buffers once what was asked before is done."""
        self._jobs.put(("trim", None))

    def flush(self) -> None:
        """Block until every job asked so far is done."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        done.wait()

    def close(self) -> None:
        """Finish every job asked so far, then stop."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join()

    def _run(self) -> None:
        carried = None
        while True:
            job = carried or self._jobs.get()
            carried = None
            if job is _STOP:
                return
            batch = [job]
            while len(batch) < MAX_BATCH:
                try:
                    following = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if following is _STOP or not _same_batch(job, following):
                    carried = following
                    break
                batch.append(following)
            transfers = [transfer for _, transfer in batch]
            try:
                self._process(job[0], transfers)
            except Exception as error:  # noqa: BLE001 - the thread must live on; every transfer hears of it
                for transfer in transfers:
                    if isinstance(transfer, FileTransfer) and transfer.error is None:
                        self._fail(transfer, job[0], error)

    def _process(self, kind: str, transfers: list) -> None:
        if kind == "flush":
            for done in transfers:
                done.set()
            return
        if kind == "trim":
            self._pool.trim()
            return
        if kind == "discard":
            for transfer in transfers:
                self._drop(transfer)
            return
        start = time.perf_counter()
        submitted = [transfer for transfer in transfers if self._submit(kind, transfer)]
        if submitted:
            completed = self._handle.wait()
            for transfer in submitted:
                if completed != len(submitted):
                    self._fail(transfer, kind, f"the aio handle completed {completed} of {len(submitted)} operations")
                elif kind == "write":
                    self._written(transfer)
                else:
                    self._read(transfer)
        elapsed = time.perf_counter() - start
        moved = sum(transfer.payload_bytes for transfer in submitted if transfer.error is None)
        with self._stats_lock:
            self._stats["written_bytes" if kind == "write" else "read_bytes"] += moved
            self._stats["write_s" if kind == "write" else "read_s"] += elapsed

    def _submit(self, kind: str, transfer: FileTransfer) -> bool:
        """Start the transfer's write or read; False (with its error set) when it cannot start."""
        try:
            if kind == "write":
                if transfer.copied is not None:
                    transfer.copied.synchronize()
                result = self._handle.async_pwrite(transfer.staging[: transfer.io_bytes], transfer.path)
            else:
                if transfer.error is not None or transfer.discarded:
                    return False
                transfer.data = self._pool.take(transfer.io_bytes)
                _check_file_holds(transfer.path, transfer.io_bytes)
                result = self._handle.async_pread(transfer.data[: transfer.io_bytes], transfer.path)
            if result != 0:
                raise _diagnose(kind, transfer.path)
            return True
        except Exception as error:  # noqa: BLE001 - any failure belongs to this transfer, raised where it is needed
            self._fail(transfer, kind, error)
            return False

    def _written(self, transfer: FileTransfer) -> None:
        try:
            size = os.path.getsize(transfer.path)
        except OSError as error:
            self._fail(transfer, "write", error)
            return
        if size != transfer.io_bytes:
            self._fail(transfer, "write", f"the file holds {size} bytes after writing {transfer.io_bytes}")
            return
        self._pool.give(transfer.staging)
        transfer.staging, transfer.on_disk = None, True
        if transfer.discarded:
            self._drop(transfer)

    def _read(self, transfer: FileTransfer) -> None:
        self._remove_file(transfer)
        transfer.back.set()
        if transfer.discarded:
            self._drop(transfer)

    def _fail(self, transfer: FileTransfer, kind: str, error: Exception | str) -> None:
        verb = "writing" if kind == "write" else "reading"
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        transfer.error = OSError(f"activation offload: {verb} {transfer.path} failed: {reason}")
        for buffer in (transfer.staging, transfer.data):
            if buffer is not None:
                self._pool.give(buffer)
        transfer.staging = transfer.data = None
        self._remove_file(transfer)
        transfer.back.set()
        self._on_error(transfer)

    def _drop(self, transfer: FileTransfer) -> None:
        self._remove_file(transfer)
        if transfer.data is not None and transfer.back.is_set():
            if transfer.copied is not None:
                transfer.copied.synchronize()  # CUDA: the copy out of this buffer to the device
            self._pool.give(transfer.data)
            transfer.data = None

    @staticmethod
    def _remove_file(transfer: FileTransfer) -> None:
        try:
            os.unlink(transfer.path)
        except FileNotFoundError:
            pass
        transfer.on_disk = False


def _same_batch(first: tuple, following: tuple) -> bool:
    """Writes go together; reads only with reads of the same layer, whose backward needs them at once."""
    (kind, transfer), (next_kind, next_transfer) = first, following
    if kind != next_kind or kind in ("discard", "flush", "trim"):
        return kind == next_kind
    return kind == "write" or transfer.layer == next_transfer.layer


def _check_file_holds(path: str, nbytes: int) -> None:
    size = os.path.getsize(path)  # FileNotFoundError names the path
    if size < nbytes:
        raise OSError(f"the file holds {size} bytes, {nbytes} expected (truncated)")


def _diagnose(kind: str, path: str) -> OSError:
    """Why the aio handle could not open `path` (it prints only an errno): open it the same way."""
    try:
        if kind == "write":
            with open(path, "ab"):
                pass
        else:
            with open(path, "rb"):
                pass
    except OSError as error:
        return error
    return OSError(f"the aio handle refused the {kind} (see DeepSpeed's message above)")


class NvmeStore:
    """This rank's files under `root` (a folder of its own, named for the rank, unique to the process),
    the aligned buffer pool and the worker."""

    def __init__(self, root: str, rank: int, settings: AioSettings, on_error: Callable[[FileTransfer], None],
                 pinned: bool):
        aio_op = load_aio_op()
        io_handle, alloc_handle = settings.new_handle(aio_op), settings.new_handle(aio_op)
        alignment = io_handle.get_alignment() * settings.intra_op_parallelism
        self.pool = pinned_buffer_pool(alignment) if pinned else locked_buffer_pool(alloc_handle, alignment)
        self._alloc_handle = alloc_handle  # frees the locked buffers in close()
        self.folder = tempfile.mkdtemp(prefix=f"lazyzero_activations_rank{rank}_", dir=root)
        self.worker = NvmeWorker(io_handle, self.pool, on_error)
        self._sequence = itertools.count()

    def new_path(self, layer: int) -> str:
        return os.path.join(self.folder, f"{next(self._sequence):09d}_layer{layer}.act")

    def close(self) -> None:
        """After the worker stopped: remove the folder and every file in it, free the buffers."""
        self.worker.close()
        if os.path.isdir(self.folder):
            shutil.rmtree(self.folder)
        self.pool.close()
