"""The end of a job with lazy checkpoints (docs/checkpoint.md, "The end of a job").

A lazy save returns before its files are committed, so whatever ends the job first waits for every
queued checkpoint to commit and then stops the background threads, on every rank:
- the Hugging Face Trainer's `train()` returning (trainer_end.py's callback: waits, keeps the threads);
- `engine.destroy()` (the checkpoint feature's `close`);
- `torch.distributed.destroy_process_group()` of the world group (Accelerate's `end_training`, a
  script's last lines), routed here through the patch point, since the commit's agreement runs on a
  group that dies with the world group;
- the interpreter's exit (a plain script's last line, an uncaught exception, a SIGTERM stop), from a
  hook that runs before Python shuts its thread pools down (the writers are one), which a plain
  `atexit` handler would run after.
Each waits at most `checkpoint.exit_timeout_s` and says every few seconds what it waits for. A commit
that fails or times out is raised where the job can still catch it, and at interpreter exit is
printed on stderr with its tag and reason, and the process exits with status 1.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref

from lazyzero.checkpoint.lazy_engine import CheckpointFailedError, LazyCheckpointEngine
from lazyzero.distributed.job_failure import BEFORE_MPI_ABORT, peer_lost
from lazyzero.patch_point import route_function

OWNER = "lazyzero.checkpoint (end of job)"
_engines: weakref.WeakSet[LazyCheckpointEngine] = weakref.WeakSet()
_installed = False


def register(engine: LazyCheckpointEngine) -> None:
    """Make the end of the job wait for `engine`'s queued checkpoints (hooks installed once per process)."""
    global _installed
    _engines.add(engine)
    if not _installed:
        _install_exit_hook()
        _route_destroy_process_group()
        BEFORE_MPI_ABORT.append(_report_at_exit)
        _installed = True


def finish_pending_checkpoints(close: bool) -> None:
    """Wait for every live lazy checkpoint engine's queued checkpoints to commit (each within its
    `exit_timeout_s`) and, with `close`, stop their threads. Every engine is waited for before the
    failures are raised together (CheckpointFailedError)."""
    failures = []
    for engine in list(_engines):
        finish = engine.close if close else engine.wait
        try:
            finish(engine.config.exit_timeout_s, _progress_printer(engine.rank))
        except CheckpointFailedError as failure:
            failures.append(failure)
    if len(failures) == 1:
        raise failures[0]
    if failures:
        raise CheckpointFailedError("\n".join(str(failure) for failure in failures))


def _progress_printer(rank: int):
    def say(tag: str, save_dir, waited_s: float) -> None:
        if rank == 0:
            print(f"lazyzero: waiting for checkpoint {tag!r} in {save_dir} to commit ({waited_s:.0f} s so far; "
                  "at most lazyzero.checkpoint.exit_timeout_s)", file=sys.stderr, flush=True)

    return say


def _install_exit_hook() -> None:
    """`_at_interpreter_exit` runs when the main thread has ended, before Python joins threads and
    shuts thread pools down: `threading._register_atexit`, the hook concurrent.futures registers its
    own pool shutdown with (callbacks run newest first, so this one runs before the pools stop);
    a plain `atexit` callback would run after them, with no writer left (docs/deepspeed-internals.md)."""
    threading._register_atexit(_at_interpreter_exit)


def _at_interpreter_exit() -> None:
    if peer_lost(getattr(sys, "last_value", None)):
        # The main thread died of a lost rank (printed above): no commit can agree without it, so
        # nothing is waited for and the daemon threads end with the process (reliability.md, guarantee 5).
        return
    if not _report_at_exit():
        # A timed-out wait leaves a thread inside a collective, which finalization cannot join.
        os._exit(1)


def _report_at_exit() -> bool:
    """Finish every queued checkpoint; a failure is printed on stderr. Whether all committed."""
    try:
        finish_pending_checkpoints(close=True)
    except CheckpointFailedError as failure:
        sys.stdout.flush()
        print(str(failure), file=sys.stderr, flush=True)
        return False
    return True


def _route_destroy_process_group() -> None:
    import torch.distributed

    route_function(torch.distributed, "destroy_process_group", destroy_process_group_after_commits, owner=OWNER)


def destroy_process_group_after_commits(group=None):
    """torch's `destroy_process_group`; destroying the world group first commits what is queued."""
    import torch.distributed

    original = torch.distributed.destroy_process_group.__wrapped__
    if group is None or group is torch.distributed.GroupMember.WORLD:
        finish_pending_checkpoints(close=True)
    return original(group)
