"""How the profiler (and the benchmarks) measure: median wall times, memory peaks, process memory.

Peak memory: GPU max allocated on CUDA; on the CPU the C heap's live bytes. On the CPU torch
allocates tensors with malloc (no caching allocator), so glibc's `mallinfo2` (bytes in use in every
arena plus mmapped chunks) is the memory tensors hold at that moment. It is read after every aten
operation, forward and backward, through a TorchDispatchMode: the peak inside one operation (its
scratch buffers) is missed.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _load_mallinfo2():
    """glibc's mallinfo2, or None where the C library has none (musl, macOS, glibc < 2.33)."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    function.restype = _Mallinfo2
    return function


_mallinfo2 = _load_mallinfo2()


def heap_sampling_available() -> bool:
    return _mallinfo2 is not None


def heap_live_bytes() -> int:
    """Bytes the C heap has handed out and not taken back (small chunks plus mmapped ones)."""
    if _mallinfo2 is None:
        raise RuntimeError("heap sampling needs glibc's mallinfo2 (glibc 2.33 or later)")
    info = _mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _PeakSampler(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.peak = heap_live_bytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, heap_live_bytes())
        return result


def peak_bytes(work: Callable[[], object], device: torch.device, floor: int = 0) -> int:
    """Peak bytes held while `work()` runs (everything live, not only what `work` allocates); on the
    CPU less `floor`, the heap the process held before its tensors (from `heap_live_bytes`)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        work()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    with _PeakSampler() as sampler:
        work()
    return sampler.peak - floor


@dataclass(frozen=True)
class PhaseMemory:
    """Live bytes when a phase of work starts and ends, and the most it held in between."""

    start: int
    peak: int
    end: int

    @property
    def transient(self) -> int:
        """Peak above the larger of start and end: temporaries the phase frees before it ends."""
        return max(0, self.peak - max(self.start, self.end))


def phase_memory(work: Callable[[], object], device: torch.device) -> PhaseMemory:
    """Live bytes around `work()` (GPU allocated memory on CUDA, the C heap on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        work()
        torch.cuda.synchronize()
        return PhaseMemory(start, int(torch.cuda.max_memory_allocated()), torch.cuda.memory_allocated())
    start = heap_live_bytes()
    with _PeakSampler() as sampler:
        work()
    end = heap_live_bytes()
    return PhaseMemory(start, max(sampler.peak, end), end)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that a clock reading after it means the work is done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(work: Callable[[], object], repeats: int, warmup: int, device: torch.device) -> float:
    """Median wall time of `work()` over `repeats` runs after `warmup` untimed ones (the median, so
    that one descheduled run on a shared machine does not move the result)."""
    for _ in range(warmup):
        work()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def process_rss_bytes() -> int:
    """Resident memory of this process now."""
    return int(psutil.Process(os.getpid()).memory_info().rss)
