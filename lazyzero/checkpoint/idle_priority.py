"""Background threads that run only on the CPU time and disk time training leaves idle.

A lazy checkpoint is paid for with time training does not use (docs/checkpoint.md, "Scheduling"):
its snapshot copy, flush, writer and I/O threads call `lower_current_thread` first. On Linux that
puts the calling thread (not the process: the scheduler's unit is the thread) in the idle CPU
scheduling class, SCHED_IDLE, which any normal thread preempts, and in the idle I/O priority
class, whose requests a disk scheduler that honours classes (BFQ, mq-deadline) serves after
everyone else's. Where the platform refuses either (not Linux, an
architecture whose syscall number is not known here, a seccomp filter, EPERM), the thread keeps its
normal priority and the returned `ThreadPriority` says why; nothing is raised.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import threading
from dataclasses import dataclass

IDLE, NORMAL = "idle", "normal"

# linux/ioprio.h: the class sits above 13 bits of per-class level; IOPRIO_WHO_PROCESS with who 0 is
# the calling thread.
IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_IDLE = 3
IOPRIO_WHO_PROCESS = 1
# (ioprio_set, ioprio_get) per 64-bit architecture (the kernel's syscall tables).
IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31)}


@dataclass(frozen=True)
class ThreadPriority:
    """What one thread runs at, as the kernel reports it after the attempt: `cpu` and `io` are
    "idle" or "normal"; `reason` says why a class asked for is "normal" (None when all were set)."""

    native_id: int
    cpu: str
    io: str
    reason: str | None = None


def lower_current_thread() -> ThreadPriority:
    """Put the calling thread in the idle CPU and I/O classes; a class the platform refuses is left
    normal, with the reason. Call it first thing in the thread: threads it starts afterwards inherit
    its classes."""
    cpu_refused, io_refused = _set_idle_cpu(), _set_idle_io()
    reasons = [reason for reason in (cpu_refused, io_refused) if reason]
    return ThreadPriority(threading.get_native_id(), NORMAL if cpu_refused else IDLE,
                          NORMAL if io_refused else IDLE, "; ".join(reasons) or None)


def thread_io_class(native_id: int) -> int | None:
    """The I/O priority class (IOPRIO_CLASS_*) of a thread of this process, or None where it cannot be read."""
    syscalls = _ioprio_syscalls()
    if isinstance(syscalls, str):
        return None
    value = _syscall(syscalls[1], IOPRIO_WHO_PROCESS, native_id)
    return None if value < 0 else value >> IOPRIO_CLASS_SHIFT


def availability() -> list[str]:
    """One line per class: whether this machine gives a thread idle CPU and idle I/O priority, and
    why not. Probed in a short-lived thread of its own, so the caller's priority is not changed."""
    refusals: list[str | None] = []
    probe = threading.Thread(target=lambda: refusals.extend([_set_idle_cpu(), _set_idle_io()]),
                             name="lazyzero-priority-probe")
    probe.start()
    probe.join()
    return [f"idle {kind} priority for checkpoint threads ({name}): "
            + ("available" if refused is None else f"unavailable, they run at normal priority ({refused})")
            for kind, name, refused in zip(("CPU", "I/O"), ("SCHED_IDLE", "IOPRIO_CLASS_IDLE"), refusals)]


def _set_idle_cpu() -> str | None:
    """Why the calling thread could not be put in SCHED_IDLE; None once it is."""
    if not hasattr(os, "SCHED_IDLE"):
        return f"SCHED_IDLE: not offered on {sys.platform}"
    try:
        # pid 0 is the calling thread: Linux schedules threads, each with its own policy.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        policy = os.sched_getscheduler(0)
    except OSError as err:
        return f"SCHED_IDLE refused: {err.strerror or err}"
    return None if policy == os.SCHED_IDLE else f"SCHED_IDLE not kept: the policy reads {policy}"


def _set_idle_io() -> str | None:
    """Why the calling thread could not be put in the idle I/O class; None once it is."""
    syscalls = _ioprio_syscalls()
    if isinstance(syscalls, str):
        return f"IOPRIO_CLASS_IDLE: {syscalls}"
    ioprio_set, ioprio_get = syscalls
    if _syscall(ioprio_set, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT) < 0:
        return f"IOPRIO_CLASS_IDLE refused: {os.strerror(ctypes.get_errno())}"
    value = _syscall(ioprio_get, IOPRIO_WHO_PROCESS, 0)
    if value < 0 or value >> IOPRIO_CLASS_SHIFT != IOPRIO_CLASS_IDLE:
        return f"IOPRIO_CLASS_IDLE not kept: ioprio_get reads {value}"
    return None


def _ioprio_syscalls() -> tuple[int, int] | str:
    """(ioprio_set, ioprio_get) syscall numbers of this platform, or why there are none."""
    if not sys.platform.startswith("linux"):
        return f"not offered on {sys.platform}"
    if sys.maxsize <= 2**32:
        return "syscall numbers not known for a 32-bit Python"
    machine = platform.machine()
    if machine not in IOPRIO_SYSCALLS:
        return f"syscall numbers not known for {machine}"
    return IOPRIO_SYSCALLS[machine]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: int) -> int:
    """libc's syscall(2): its result, or -1 with ctypes.get_errno() set."""
    return _libc().syscall(ctypes.c_long(number), *(ctypes.c_long(arg) for arg in args))
