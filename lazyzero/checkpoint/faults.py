"""Fault injection for the checkpoint path, chosen by environment variables (docs/reliability.md, what is tested and 3).

`LAZYZERO_FAILPOINT=NAME[@RANK][#N]`: the process SIGKILLs itself the N-th time (default 1st) it
reaches failpoint NAME, only on global rank RANK when given. A kill, not an exception: nothing gets
a chance to clean up, exactly as a power cut or the OOM killer leaves it. With
`LAZYZERO_FAILPOINT_SIGNAL=SIGSTOP` it stops itself instead: alive, holding its connections, and
silent, as a rank stuck in the kernel or under a debugger (docs/reliability.md, guarantee 5).

`LAZYZERO_IO_FAULT=OP:N[:ERRNO][@RANK]`: the N-th checkpoint I/O call of kind OP (write, fsync,
rename) in this process raises OSError(ERRNO) (default ENOSPC, "disk full"); N counts from 1.

Both are read at each call, so a test can set them in a child's environment and nothing else.
"""

from __future__ import annotations

import errno as errno_codes
import os
import signal
import threading
from collections import Counter

FAILPOINTS = (
    "after_snapshot",    # snapshot taken: host copies done, host-resident files written, nothing fsynced
    "mid_file",          # half of this rank's first file serialized (copied into staging blocks)
    "before_manifest",   # every rank's files written and fsynced
    "after_manifest",    # manifest written, temporary folder not yet renamed
    "after_rename",      # tag folder in place, 'latest' not yet updated
    "after_latest",      # 'latest' updated, retention not yet applied
)
IO_OPS = ("write", "fsync", "rename")

_reached = Counter()
_io_calls = Counter()
_lock = threading.Lock()


def _this_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def _split_rank(spec: str) -> tuple[str, int | None]:
    if "@" not in spec:
        return spec, None
    body, rank = spec.rsplit("@", 1)
    return body, int(rank)


def failpoint(name: str) -> None:
    """SIGKILL (or LAZYZERO_FAILPOINT_SIGNAL) this process if LAZYZERO_FAILPOINT selects `name` here and now."""
    assert name in FAILPOINTS, name
    spec = os.environ.get("LAZYZERO_FAILPOINT")
    if not spec:
        return
    spec, nth = (spec.split("#", 1) + ["1"])[:2]
    target, rank = _split_rank(spec)
    if target != name or (rank is not None and rank != _this_rank()):
        return
    with _lock:
        _reached[name] += 1
        hit = _reached[name] == int(nth)
    if hit:
        os.kill(os.getpid(), _failpoint_signal())


def _failpoint_signal() -> signal.Signals:
    name = os.environ.get("LAZYZERO_FAILPOINT_SIGNAL", "SIGKILL")
    if name not in ("SIGKILL", "SIGSTOP"):
        raise ValueError(f"LAZYZERO_FAILPOINT_SIGNAL: got {name!r}; allowed: 'SIGKILL', 'SIGSTOP'")
    return getattr(signal, name)


def io_fault(op: str, path: str) -> None:
    """Raise the OSError LAZYZERO_IO_FAULT asks for at this `op` call, if it is the chosen one."""
    assert op in IO_OPS, op
    spec = os.environ.get("LAZYZERO_IO_FAULT")
    if not spec:
        return
    spec, rank = _split_rank(spec)
    parts = spec.split(":")
    if parts[0] != op or (rank is not None and rank != _this_rank()):
        return
    with _lock:
        _io_calls[op] += 1
        hit = _io_calls[op] == int(parts[1])
    if hit:
        code = getattr(errno_codes, parts[2]) if len(parts) > 2 else errno_codes.ENOSPC
        raise OSError(code, f"{os.strerror(code)} (injected by LAZYZERO_IO_FAULT={os.environ['LAZYZERO_IO_FAULT']})",
                      path)
