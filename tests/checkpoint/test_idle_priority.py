"""idle_priority: the calling thread alone goes to the idle CPU and I/O classes, as the kernel reports
them from outside that thread; a refusal leaves it at normal priority with the reason, and no error."""

import ctypes
import errno
import os
import sys
import threading

import pytest

from lazyzero.checkpoint import idle_priority
from lazyzero.checkpoint.idle_priority import IDLE, IOPRIO_CLASS_IDLE, NORMAL, lower_current_thread, thread_io_class

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE and ioprio are Linux's")


def kernel_policy(native_id: int) -> int:
    """The thread's scheduling policy from /proc (field 41 of proc_pid_stat(5)), not through the helper."""
    with open(f"/proc/self/task/{native_id}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[41 - 3])


class Parked:
    """A thread that runs `first` (None: nothing), then waits until released, so that its
    priority can be read from outside while it is alive."""

    def __init__(self, first=None):
        self.result, self._ready, self._release = None, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(first,))
        self.thread.start()
        self._ready.wait()

    def _run(self, first) -> None:
        self.native_id = threading.get_native_id()
        self.result = first() if first else None
        self._ready.set()
        self._release.wait()

    def release(self) -> None:
        self._release.set()
        self.thread.join()


@pytest.fixture
def normal_caller() -> int:
    """The test thread's policy (SCHED_OTHER unless run under chrt), which other threads keep."""
    policy = os.sched_getscheduler(0)
    if policy == os.SCHED_IDLE:
        pytest.skip("the test process already runs at idle priority")
    return policy


@linux_only
def test_the_calling_thread_alone_goes_idle(normal_caller):
    lowered, bystander = Parked(lower_current_thread), Parked()
    try:
        assert lowered.result == idle_priority.ThreadPriority(lowered.native_id, IDLE, IDLE, None)
        assert os.sched_getscheduler(lowered.native_id) == os.SCHED_IDLE == kernel_policy(lowered.native_id)
        assert thread_io_class(lowered.native_id) == IOPRIO_CLASS_IDLE
        for other in (bystander.native_id, threading.get_native_id()):
            assert os.sched_getscheduler(other) == normal_caller == kernel_policy(other)
            assert thread_io_class(other) != IOPRIO_CLASS_IDLE
    finally:
        lowered.release(), bystander.release()


def refuse_everything(monkeypatch) -> None:
    """The kernel says EPERM to both classes (a seccomp filter or a container's policy)."""
    def refused_scheduler(*args):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    def refused_syscall(*args):
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(os, "sched_setscheduler", refused_scheduler)
    monkeypatch.setattr(idle_priority, "_syscall", refused_syscall)


@linux_only
def test_a_refusal_leaves_normal_priority_and_says_why(monkeypatch, normal_caller):
    refuse_everything(monkeypatch)
    lowered = Parked(lower_current_thread)
    try:
        assert (lowered.result.cpu, lowered.result.io) == (NORMAL, NORMAL)
        denied = os.strerror(errno.EPERM)
        assert lowered.result.reason == f"SCHED_IDLE refused: {denied}; IOPRIO_CLASS_IDLE refused: {denied}"
        assert kernel_policy(lowered.native_id) == normal_caller
    finally:
        lowered.release()
    assert idle_priority.availability() == [
        f"idle CPU priority for checkpoint threads (SCHED_IDLE): unavailable, they run at normal priority "
        f"(SCHED_IDLE refused: {denied})",
        f"idle I/O priority for checkpoint threads (IOPRIO_CLASS_IDLE): unavailable, they run at normal priority "
        f"(IOPRIO_CLASS_IDLE refused: {denied})"]


def test_a_platform_without_either_class_falls_back_without_calling_the_kernel(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.delattr(os, "SCHED_IDLE", raising=False)
    monkeypatch.setattr(idle_priority, "_syscall", lambda *args: pytest.fail("a syscall on a platform without it"))
    result = []
    thread = threading.Thread(target=lambda: result.append(lower_current_thread()))
    thread.start(), thread.join()
    assert (result[0].cpu, result[0].io) == (NORMAL, NORMAL)
    assert result[0].reason == "SCHED_IDLE: not offered on darwin; IOPRIO_CLASS_IDLE: not offered on darwin"
    assert thread_io_class(threading.get_native_id()) is None


def test_an_architecture_without_known_syscall_numbers_falls_back(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(idle_priority.platform, "machine", lambda: "riscv64")
    assert idle_priority._set_idle_io() == "IOPRIO_CLASS_IDLE: syscall numbers not known for riscv64"


@linux_only
def test_availability_says_available_here_and_leaves_the_caller_alone(normal_caller):
    lines = idle_priority.availability()
    assert [line.split(": ")[1] for line in lines] == ["available", "available"]
    assert kernel_policy(threading.get_native_id()) == normal_caller
