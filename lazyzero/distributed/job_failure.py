"""A rank that dies or stops ends the job: bounded collectives, and an error that ends every rank
(docs/reliability.md, guarantee 5).

A rank that dies closes its gloo connections and its peers' collectives raise at once; a rank that
is stopped (SIGSTOP, a hung file system, a debugger) keeps them open, and its peers wait as long as
their group's timeout allows. DeepSpeed passes a timeout to the world group only: the groups it
creates with `new_group` afterwards (ZeRO's clone of the world group, which carries every gradient
and parameter collective) get torch's default of 30 minutes. So once the engine is built, every group
this rank belongs to is given `lazyzero.distributed.timeout_s`, and lazyzero's own groups are created
with it.

The error then has to end the process. Under mpirun, DeepSpeed's rank discovery initializes MPI
(mpi4py), and mpi4py finalizes MPI at exit: MPI_Finalize waits for every rank, so a rank leaving
with an error waits forever for a stopped peer. An uncaught error therefore aborts the MPI job
(MPI_Abort, as `python -m mpi4py` does), which makes mpirun end every rank, the stopped one too.
"""

from __future__ import annotations

import sys
from datetime import timedelta

from lazyzero.distributed.refusal_line import is_refusal, print_refusal, prints_tracebacks_only

# Called, in order, before an uncaught error aborts the MPI job, when no peer was lost (the lazy
# checkpoints' end of job registers here: checkpoint/job_end.py). Each reports its own failures.
BEFORE_MPI_ABORT: list = []

# What gloo's errors say when a peer is gone (the process died) or silent (stopped) past the timeout.
PEER_LOST_MESSAGES = ("Connection closed by peer", "Timed out waiting", "Connection reset by peer")


def collective_timeout(lazyzero_config) -> timedelta:
    """`lazyzero.distributed.timeout_s` of a validated config, as torch.distributed takes it."""
    return timedelta(seconds=lazyzero_config.distributed.timeout_s)


def apply_to_every_group(timeout: timedelta) -> int:
    """Give every process group this rank belongs to `timeout`; returns how many there are.

    torch has no public setter for an existing group's timeout; `_set_pg_timeout` is the one its
    documentation offers for this (torch/distributed/distributed_c10d.py)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return 0
    groups = list(c10d._world.pg_map)
    for group in groups:
        c10d._set_pg_timeout(timeout, group)
    return len(groups)


def end_job_on_uncaught_error(timeout: timedelta) -> None:
    """From now on, an exception that ends this process's main thread is printed as usual, with a
    line naming the timeout when a peer was lost, and then aborts the MPI job when MPI is in use.
    A refusal (`refusal_line.py`) is printed as its one line instead of Python's traceback; a hook
    installed before this one still runs first otherwise. Installed once per process."""
    if getattr(sys.excepthook, "lazyzero_timeout", None) is not None:
        sys.excepthook.lazyzero_timeout = timeout
        return
    previous = sys.excepthook

    def hook(kind, error, traceback):
        if is_refusal(error):
            if not prints_tracebacks_only(previous):  # someone else's hook (a tracker's) still hears of it
                previous(kind, error, traceback)
            print_refusal(error, traceback)
        else:
            previous(kind, error, traceback)
        if peer_lost(error):
            print(f"lazyzero: another rank stopped answering (dead, or stopped for longer than "
                  f"lazyzero.distributed.timeout_s = {hook.lazyzero_timeout.total_seconds():g} s); "
                  "this rank ends the job", file=sys.stderr, flush=True)
        elif _mpi_job_running():
            for finish in BEFORE_MPI_ABORT:  # work the abort would cut short, with every peer still there
                finish()
        _abort_mpi_job()

    hook.lazyzero_timeout = timeout
    sys.excepthook = hook


def peer_lost(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from, is a collective that lost a peer."""
    while error is not None:
        if any(message in str(error) for message in PEER_LOST_MESSAGES):
            return True
        error = error.__cause__ or error.__context__
    return False


def _mpi_job_running() -> bool:
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def _abort_mpi_job() -> None:
    if not _mpi_job_running():
        return
    mpi = sys.modules["mpi4py.MPI"]
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.COMM_WORLD.Abort(1)
