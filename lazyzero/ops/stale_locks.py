"""Remove the build locks that killed processes leave in torch's extension cache.

`torch.utils.cpp_extension.load` (through which lazyzero's kernels and DeepSpeed's ops are built and
loaded) takes a lock file, `<build folder>/lock`, around every build, even one that finds nothing to
do, and every later load waits while that file exists, with no timeout. A process killed inside that
window (a rank the launcher kills, a job past its time limit, Ctrl-C twice) leaves the file behind, and
every later job on the machine hangs at its first op, silently (docs/reliability.md, "stale build
lock"). From torch 2.14 on the lock is advisory (the kernel releases it when its holder dies, and
its file stays after every load), so nothing is left to clear there; removing a file no process
holds is harmless either way.

The process that takes the lock holds the file open until it removes it, so a lock that no process
holds open is stale. This module looks in /proc, so it sees only this machine's processes and, unless
run as root, only its own user's: it removes a lock only when the file belongs to this user and no
process of this user has it open. On a cache shared by several machines (an NFS home) a lock held on
another machine would look stale; `LAZYZERO_KEEP_BUILD_LOCKS=1` turns the clean-up off there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch.utils.cpp_extension as cpp_extension

logger = logging.getLogger(__name__)

LOCK_NAME = "lock"
KEEP_ENV = "LAZYZERO_KEEP_BUILD_LOCKS"
_PROC = Path("/proc")


def extension_root() -> Path:
    """torch's extension cache: $TORCH_EXTENSIONS_DIR, else torch's default."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def _open_by_a_process(path: Path) -> bool:
    """Whether a process of this machine that we may inspect has `path` open."""
    target = str(path)
    for process in _PROC.iterdir():
        if not process.name.isdigit():
            continue
        try:
            for descriptor in (process / "fd").iterdir():
                if os.readlink(descriptor) == target:
                    return True
        except OSError:  # the process ended, or it is another user's
            continue
    return False


def clear_if_stale(lock: Path) -> bool:
    """Remove `lock` when no process holds it open; whether it was removed."""
    try:
        before = lock.stat()
    except FileNotFoundError:
        return False
    if before.st_uid != os.geteuid() or _open_by_a_process(lock):
        return False
    try:
        after = lock.stat()
        if (after.st_ino, after.st_mtime_ns) != (before.st_ino, before.st_mtime_ns):
            return False  # a live build replaced it while we looked
        lock.unlink()
    except FileNotFoundError:
        return False
    logger.warning("lazyzero: removed the stale build lock %s, left by a process that was killed while "
                   "it built or loaded an op (no process holds it)", lock)
    return True


def clear_stale_build_locks(root: Path | None = None) -> list[Path]:
    """Remove every stale lock in the extension cache (its folders one and two levels down: torch's
    `py311_cpu/<op>` and lazyzero's `lazyzero_<tags>/<library>`); the locks removed."""
    if os.environ.get(KEEP_ENV) == "1" or not _PROC.is_dir():
        return []
    root = extension_root() if root is None else root
    if not root.is_dir():
        return []
    candidates = [*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")]
    return [lock for lock in candidates if clear_if_stale(lock)]
