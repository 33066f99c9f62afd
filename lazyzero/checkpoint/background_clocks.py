"""CPU seconds used by a lazy checkpoint engine's background threads, read from their own CPU clocks.

Wall-clock stalls on a shared host drift by tens of percent within minutes; the CPU time the
snapshot, flush and writer threads consume does not, so it is what the checkpoint benchmark
reports beside the stall (docs/checkpoint.md, "What a checkpoint costs").
"""

from __future__ import annotations

import os
import threading


class BackgroundClocks:
    """The threads registered here; `seconds()` sums their CPU clocks (threads that ended keep the
    time they had when last read)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._threads: dict[int, float] = {}  # kernel thread id -> CPU seconds when last read

    def register_current(self) -> None:
        with self._lock:
            self._threads[threading.get_native_id()] = 0.0

    def seconds(self) -> float:
        with self._lock:
            for ident in self._threads:
                self._threads[ident] = _thread_cpu_seconds(ident, self._threads[ident])
            return sum(self._threads.values())


_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _thread_cpu_seconds(native_id: int, last_read: float) -> float:
    """CPU time of one thread of this process, from /proc: the scheduler's nanosecond count where the
    kernel keeps one (`schedstat`), else user plus system time in clock ticks (10 ms: a thread that
    hashed and wrote a few MB reads 0 there). Read by kernel id rather than through
    pthread_getcpuclockid: that one is undefined for a thread that has ended, and writer threads end
    when their pool shuts down."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as schedstat:
            return int(schedstat.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/self/task/{native_id}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:
        return last_read  # not Linux, or the thread has ended
    # After the command name: state is field 3 of proc_pid_stat(5); utime and stime are 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
