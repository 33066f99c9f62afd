"""SIGTERM with lazy checkpoints (docs/checkpoint.md, "SIGTERM and preemption").

Clusters stop a job with SIGTERM and kill it a grace period later (SLURM, Kubernetes; DeepSpeed's
launcher passes a SIGTERM of its own to every rank and kills them 30 s later). The handler only
records the signal: at every optimizer step the ranks agree, with a one-number all-reduce on a gloo
group of their own, whether any of them received it, so that all stop after the same step even when
the signal reached them at different moments, or only one of them. Then, in order:
1. with `checkpoint.save_on_sigterm`, one more checkpoint at that step;
2. every queued checkpoint commits (job_end.py);
3. rank 0 prints what was saved, and every rank exits with status 143 (128 + SIGTERM).
A training loop may claim the stop and act on it itself: the Hugging Face Trainer's callback
(trainer_end.py) has the Trainer save its own checkpoint-N folder and end `train()`. Otherwise the
engine acts at the end of its `step()`, saving into the folder of its last save.
"""

from __future__ import annotations

import signal
import sys
import threading
from datetime import timedelta

import torch

EXIT_STATUS = 128 + signal.SIGTERM
_active: StopOnSigterm | None = None


class StopOnSigterm:
    """The SIGTERM handler of one engine and the ranks' agreement on it. Built collectively (it
    creates a process group) by every rank's checkpoint feature."""

    def __init__(self, rank: int, world_size: int, save: bool, timeout: timedelta | None):
        global _active
        self.rank, self.save = rank, save
        self.received = False
        self.stop_step: int | None = None  # the step after which every rank stops
        self.claimed_by: str | None = None  # a training loop that acts on the stop itself
        self._group = _agreement_group(world_size, timeout)
        self._previous = None
        self._installed = False
        if threading.current_thread() is threading.main_thread():  # Python's rule for signal handlers
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        _active = self

    def _on_signal(self, signum, frame) -> None:
        if not self.received and self.rank == 0:
            print("lazyzero: SIGTERM received: every rank stops after the next optimizer step"
                  + (" and saves a checkpoint" if self.save else ""), file=sys.stderr, flush=True)
        self.received = True
        if callable(self._previous):  # a handler the script or its trainer set before lazyzero's
            self._previous(signum, frame)

    def agree(self, step: int) -> bool:
        """Collective, at an optimizer step every rank reaches: whether any rank received SIGTERM;
        if so `stop_step` is `step` on every rank."""
        if self.stop_step is not None:
            return True
        flag = torch.tensor([int(self.received)], dtype=torch.int32)
        if self._group is not None:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        if flag.item():
            self.stop_step = step
        return self.stop_step is not None

    def exit(self, message: str) -> None:
        """Rank 0 prints `message`; every rank then waits for the others, so that none exits (and
        has its launcher end the rest, as mpirun does) before that line is out; then exits 143."""
        if self.rank == 0:
            print(message, file=sys.stderr, flush=True)
        if self._group is not None:
            torch.distributed.barrier(group=self._group)
        raise SystemExit(EXIT_STATUS)

    def uninstall(self) -> None:
        """Give SIGTERM back the handler it had before (the training is over)."""
        global _active
        if self._installed and signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, self._previous)
        self._installed = False
        if _active is self:
            _active = None


def active() -> StopOnSigterm | None:
    """The handler of the newest engine with lazy checkpoints that is still training, if any."""
    return _active


def stop_message(stop_step: int, saved: str | None, newest: str | None) -> str:
    """The line the job ends with after a SIGTERM."""
    if saved is not None:
        return f"lazyzero: stopped by SIGTERM after step {stop_step}; saved and committed {saved}; exiting with " \
               f"status {EXIT_STATUS}"
    kept = f"the newest committed checkpoint is {newest}" if newest else "no checkpoint was committed"
    return f"lazyzero: stopped by SIGTERM after step {stop_step}; {kept}; exiting with status {EXIT_STATUS}"


def _agreement_group(world_size: int, timeout: timedelta | None):
    """A gloo group for the agreement alone: the flush threads' group must not see a collective of
    the main thread interleaved with theirs, and gloo keeps the flag off the accelerator's stream."""
    if world_size <= 1 or not torch.distributed.is_initialized():
        return None
    return torch.distributed.new_group(backend="gloo", timeout=timeout)
