"""Peak memory of a piece of work: GPU max allocated on CUDA, the C heap's live bytes on the CPU.

On the CPU torch allocates tensors with malloc (no caching allocator), so glibc's `mallinfo2`
(bytes in use in every arena plus mmapped chunks) is the memory tensors hold at that moment. It is
read after every aten operation, forward and backward, through a TorchDispatchMode: the peak inside
one operation (its scratch buffers) is missed alike in every case compared.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_libc = ctypes.CDLL(None)
_libc.mallinfo2.restype = _Mallinfo2


def heap_live_bytes() -> int:
    """Bytes the C heap has handed out and not taken back (small chunks plus mmapped ones)."""
    info = _libc.mallinfo2()
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
