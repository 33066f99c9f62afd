"""One clear line per refusal (docs/reliability.md, "A refusal ends the job with one line").

A refusal (a damaged or unsafe checkpoint, one that does not fit its disk, a path leading outside its
folder, a launch lazyzero would train wrongly under) is an error whose message names the file, the
reason and the fix. Uncaught, Python prints it as the last line of a traceback, and under a launcher
every rank prints it: the launcher's output holds the same long message once per rank, between
tracebacks. Instead of Python's printer (or torch.distributed's, which prefixes it with the rank), the
refusing rank prints the traceback's frames and then, as its last line,
`lazyzero: <type>: <message>` (one line: a multi-line message is joined with "; "). Ranks that
refuse the same way as rank 0 (the same message once each rank's own numbers and file names are set
aside: every rank checks its own shards and its own free space) print a one-line pointer to rank 0's
line instead, so the launcher shows the message once. Rank 0 publishes its message in
torch.distributed's store and waits up to `PEER_WAIT_S` for the others to read it; a rank that
cannot read it within that time, or refuses differently, prints its own line in full.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from datetime import timedelta

PEER_WAIT_S = 5.0
TRACEBACK_ENV = "LAZYZERO_TRACEBACK"  # "0": the refusal line alone, without the frames
_KEY = "lazyzero/refusal"
_refusal_types: set[type] = set()


def register_refusals(*types: type) -> None:
    """Errors of `types` (and their subclasses) are refusals, printed as described above."""
    _refusal_types.update(types)


def is_refusal(error: BaseException | None) -> bool:
    return isinstance(error, tuple(_refusal_types))


def one_line(error: BaseException) -> str:
    """`lazyzero: <type>: <message>` on one line: the lines of a list ("damaged (2 problem(s)):" and a
    line per file) joined by "; "."""
    message = ""
    for line in (line.strip() for line in str(error).splitlines() if line.strip()):
        message += (" " if message.endswith(":") else "; ") + line if message else line
    return f"lazyzero: {type(error).__name__}: {message.removeprefix('lazyzero: ')}"


def prints_tracebacks_only(hook) -> bool:
    """Whether `hook` is Python's own printer, or torch.distributed's, which prints it with each line
    prefixed by the rank (`init_process_group` installs it): the ones a refusal's line replaces."""
    return hook is sys.__excepthook__ or (getattr(hook, "__module__", None) == "torch.distributed.distributed_c10d"
                                          and getattr(hook, "__name__", None) == "_distributed_excepthook")


def print_refusal(error: BaseException, frames) -> None:
    """What a rank prints for the refusal `error` raised through `frames` (a traceback), on stderr."""
    line = one_line(error)
    rank, same_as_rank0 = _agree_with_rank0(line)
    if same_as_rank0:
        print(f"lazyzero: rank {rank} stopped on the same refusal as rank 0 ({type(error).__name__}); "
              "rank 0 prints it", file=sys.stderr, flush=True)
        return
    if os.environ.get(TRACEBACK_ENV) != "0":
        print("Traceback (most recent call last):\n" + "".join(traceback.format_tb(frames)), end="",
              file=sys.stderr)
    print(line, file=sys.stderr, flush=True)
    if rank == 0:
        _wait_for_readers()


def _same_kind(line: str) -> str:
    """The line with each rank's own numbers (bytes, rank indices in file names) set aside."""
    return re.sub(r"\d+", "#", line)


def _store():
    """(rank, world size, store) of torch.distributed's default group, or None without one."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_available() or not dist.is_initialized():
            return None
        return dist.get_rank(), dist.get_world_size(), distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - reporting must not fail; without a store every rank prints in full
        return None


def _agree_with_rank0(line: str) -> tuple[int, bool]:
    """(this rank, whether rank 0 refused the same way); rank 0 publishes its line for the others."""
    found = _store()
    if found is None:
        return int(os.environ.get("RANK", "0")), False
    rank, world, store = found
    try:
        if rank == 0:
            store.set(f"{_KEY}/0", _same_kind(line))
            return 0, False
        store.wait([f"{_KEY}/0"], timedelta(seconds=PEER_WAIT_S))
        same = store.get(f"{_KEY}/0").decode() == _same_kind(line)
        store.set(f"{_KEY}/read/{rank}", "1")
        return rank, same
    except Exception:  # noqa: BLE001 - rank 0 gone, or never refused: print in full
        return rank, False


def _wait_for_readers() -> None:
    """Rank 0 keeps the store (which it serves) up until the other ranks have read its line, or
    `PEER_WAIT_S` has passed (a rank that did not refuse never reads it)."""
    found = _store()
    if found is None or found[1] == 1:
        return
    _, world, store = found
    try:
        store.wait([f"{_KEY}/read/{rank}" for rank in range(1, world)], timedelta(seconds=PEER_WAIT_S))
    except Exception:  # noqa: BLE001 - the wait is bounded; whoever has not read it prints in full
        pass
