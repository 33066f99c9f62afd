"""A build lock left by a killed process no longer hangs every later job (docs/reliability.md, "stale build
lock"): the lock torch's `cpp_extension.load` takes is removed once no process holds it, and a held one
is kept."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lazyzero.ops.native_build import build_directory, library_path
from lazyzero.ops.stale_locks import KEEP_ENV, LOCK_NAME, clear_stale_build_locks

# A process that takes a build lock the way torch's FileBaton does (created exclusively, held open), says
# so, and waits to be killed.
_HOLDER = textwrap.dedent("""
    import sys, time
    from torch.utils.file_baton import FileBaton
    baton = FileBaton(sys.argv[1])
    assert baton.try_acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def _hold_lock(lock: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_lock_held_by_a_live_build_is_kept_and_a_killed_ones_is_removed(tmp_path):
    lock = tmp_path / "py311_cpu" / "async_io" / LOCK_NAME
    lock.parent.mkdir(parents=True)
    holder = _hold_lock(lock)
    try:
        assert clear_stale_build_locks(tmp_path) == []
        assert lock.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert lock.exists(), "SIGKILL left the lock behind, as it does inside torch's cpp_extension.load"
    assert clear_stale_build_locks(tmp_path) == [lock]
    assert not lock.exists()


def test_keep_variable_turns_the_clean_up_off(tmp_path, monkeypatch):
    lock = tmp_path / "lazyzero_tags" / "lazyzero_cpu" / LOCK_NAME
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setenv("LAZYZERO_KEEP_BUILD_LOCKS", "1")
    assert clear_stale_build_locks(tmp_path) == []
    assert lock.exists()


def test_loading_the_kernels_goes_past_a_lock_a_killed_process_left(tmp_path):
    """The hang this prevents: a cached library, a lock from a killed load, then the next load."""
    if not library_path("cpu").is_file():
        pytest.skip("the CPU kernels are not built here (lazyzero ops build)")
    source = build_directory("cpu")
    root = tmp_path / "extensions"
    copy = root / source.parent.name / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(LOCK_NAME))
    holder = _hold_lock(copy / LOCK_NAME)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    load = "from lazyzero.ops.native_build import build; print([s.state for s in build(verbose=False)][0])"
    try:
        result = subprocess.run([sys.executable, "-c", load], env=environment, capture_output=True, text=True,
                                timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("the load still waits on the stale lock after 600 s")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-1] == "loaded", (result.stdout, result.stderr)
    assert "stale build lock" in result.stderr
    # What the load leaves blocks nobody: torch up to 2.13 removes its lock file, and from 2.14 on it
    # takes an advisory lock whose file stays and which the kernel releases. A load with the clean-up
    # off goes past it.
    again = subprocess.run([sys.executable, "-c", load], env={**environment, KEEP_ENV: "1"}, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.split()[-1] == "loaded", (again.stdout, again.stderr)
    assert "stale build lock" not in again.stderr
