"""When, and how fast, a lazy checkpoint's background copies may touch memory (docs/checkpoint.md, "Scheduling").

Idle priority (idle_priority.py) keeps the background threads off the cores training uses, but not
off the memory bus: a snapshot copy that bursts at memory speed beside a step slows that step. Two
rules, applied per piece copied (a staging block's 512 KiB piece, a chunk of a host view):

- **Windows.** Training closes the window while it does work no copy may overlap: the optimizer step
  (which waits for the snapshot first, so only writes are held back) and, under ZeRO-3, the
  parameter gathers of a forward pass (module pre-hooks around DeepSpeed's own). A piece waits for
  the window to open; nothing spins.
- **Rate.** With a rate set, pieces are admitted at most at that many bytes per second (a token
  bucket with a short burst), so the copy leaves the rest of the bandwidth to training. The rate is
  a share of this machine's memory copy bandwidth, measured once per process (`copy_bandwidth`).

Closing the window is counted by reason, so nested or repeated closes pair up; `open_all` (the end
of a job, a failed step) releases every waiter.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter

import numpy as np

BURST_S = 0.005  # bytes a paced copy may run ahead of its rate, in seconds of that rate
MEASURE_BYTES = 64 << 20  # larger than any last-level cache, so the copy runs at memory speed
MEASURE_REPEATS = 3


class BackgroundPace:
    """The windows and the rate of one checkpoint engine's background copies. `bytes_per_s`: None
    for no rate limit."""

    def __init__(self, bytes_per_s: float | None = None):
        self.bytes_per_s = bytes_per_s
        self._closed_by: dict[str, int] = {}
        self._changed = threading.Condition()
        self._ready_at = 0.0  # monotonic time from which the rate admits the next piece
        self.waited_s = 0.0  # time pieces waited, windows and rate together (the cost in commit time)
        self.close_counts: Counter[str] = Counter()  # closes by reason, since the engine was built

    @property
    def is_open(self) -> bool:
        with self._changed:
            return not self._closed_by

    def close(self, reason: str) -> None:
        with self._changed:
            self._closed_by[reason] = self._closed_by.get(reason, 0) + 1
            self.close_counts[reason] += 1

    def open(self, reason: str) -> None:
        with self._changed:
            count = self._closed_by.get(reason, 0) - 1
            if count > 0:
                self._closed_by[reason] = count
            else:
                self._closed_by.pop(reason, None)
                if not self._closed_by:
                    self._changed.notify_all()

    def open_all(self) -> None:
        with self._changed:
            self._closed_by.clear()
            self._changed.notify_all()

    def admit(self, nbytes: int) -> None:
        """Block until a piece of `nbytes` may be copied: the window open and, with a rate, its share
        of the rate reached."""
        started = time.monotonic()
        with self._changed:
            self._changed.wait_for(lambda: not self._closed_by)
            if self.bytes_per_s:
                now = time.monotonic()
                self._ready_at = max(self._ready_at, now - BURST_S) + nbytes / self.bytes_per_s
                # Woken early by a closing window's notify is harmless: the loop waits the rest.
                while (ahead := self._ready_at - time.monotonic() - BURST_S) > 0:
                    self._changed.wait(ahead)
            self.waited_s += time.monotonic() - started


def paced_copy(dst, src, pace: BackgroundPace | None, piece_bytes: int) -> None:
    """`dst.copy_(src)` of host tensors (`dst` contiguous), in pieces of about `piece_bytes`, each
    admitted by `pace`; a strided `src` is one piece."""
    if pace is None:
        dst.copy_(src)
        return
    if not src.is_contiguous():
        pace.admit(dst.numel() * dst.element_size())
        dst.copy_(src)
        return
    flat_dst, flat_src = dst.view(-1), src.view(-1)
    step = max(1, piece_bytes // dst.element_size())
    for start in range(0, flat_dst.numel(), step):
        piece = flat_dst[start:start + step]
        pace.admit(piece.numel() * piece.element_size())
        piece.copy_(flat_src[start:start + step])


@functools.cache
def copy_bandwidth() -> float:
    """This machine's memory copy bandwidth in bytes per second (read plus write of a 64 MiB buffer,
    the best of three): what a rate's share is taken of."""
    source = np.ones(MEASURE_BYTES, np.uint8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(MEASURE_REPEATS):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return MEASURE_BYTES / max(best, 1e-9)
