"""The end of `Trainer.train()` with lazy checkpoints (docs/checkpoint.md, "The end of a job").

`lazyzero.patch_deepspeed()` adds `LazyCheckpointsCallback` to the Hugging Face Trainer's default
callbacks (through the patch point), so every Trainer built afterwards, with no line in the script:
- when `train()` ends, waits for the lazy checkpoints still being written to commit, so that the
  final `checkpoint-N` is committed when `train()` returns (a failure is raised from `train()`);
- after a SIGTERM (preemption.py), at the optimizer step every rank agrees on, ends training, with
  `checkpoint.save_on_sigterm` after the Trainer saved its own checkpoint-N folder there, and then
  exits with status 143, saying what was committed.
With no lazyzero engine built, or lazy checkpoints off, it does nothing.
"""

from __future__ import annotations

import importlib
import sys

from transformers import TrainerCallback

from lazyzero.checkpoint import preemption
from lazyzero.checkpoint.job_end import finish_pending_checkpoints
from lazyzero.checkpoint.trainer_folders import get_last_committed_checkpoint
from lazyzero.patch_point import extend_list, retract_from_list

OWNER = "lazyzero.patch_deepspeed"
TRAINER_MODULE = "transformers.trainer"


class LazyCheckpointsCallback(TrainerCallback):
    """Commits lazy checkpoints when `train()` ends and turns a SIGTERM into a saved, clean stop."""

    def on_train_begin(self, args, state, control, **kwargs):
        stop = preemption.active()
        if stop is not None:
            stop.claimed_by = "the Hugging Face Trainer"

    def on_step_end(self, args, state, control, **kwargs):
        stop = preemption.active()
        if stop is not None and stop.stop_step is not None:
            control.should_training_stop = True
            control.should_save = control.should_save or stop.save

    def on_train_end(self, args, state, control, **kwargs):
        finish_pending_checkpoints(close=False)
        if args.should_save and args.save_total_limit:
            # Rotation left uncommitted folders out of the count (trainer_folders.py); all are committed now.
            sys.modules[TRAINER_MODULE].rotate_checkpoints(args.output_dir, args.save_total_limit,
                                                           state.best_model_checkpoint)
        stop = preemption.active()
        if stop is None:
            return
        stop.uninstall()
        if stop.stop_step is None:
            return
        newest = get_last_committed_checkpoint(args.output_dir) if stop.rank == 0 else None
        saved = newest if stop.save and newest and newest.endswith(f"-{stop.stop_step}") else None
        stop.exit(preemption.stop_message(stop.stop_step, saved, newest))


def add_to_default_callbacks() -> None:
    extend_list(importlib.import_module(TRAINER_MODULE), "DEFAULT_CALLBACKS", LazyCheckpointsCallback, owner=OWNER)


def remove_from_default_callbacks() -> None:
    trainer = sys.modules.get(TRAINER_MODULE)
    if trainer is not None:
        retract_from_list(trainer, "DEFAULT_CALLBACKS", LazyCheckpointsCallback, owner=OWNER)
