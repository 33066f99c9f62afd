"""A plain lazyzero training script, ended in the ways real scripts end (docs/checkpoint.md, "The end
of a job"); run by tests/checkpoint/test_job_end.py on 2 ranks.

The MLP, data and config of lazy_ckpt_worker.py (ZeRO-2, lazy checkpoints); a checkpoint with
DeepSpeed's default tag is saved after every SAVE_EVERY-th step, and the loss of each step is
appended to OUT/losses_rank<r>.jsonl as it is known, so a run that is stopped keeps its record.

Usage: OUT SAVE_DIR STEPS SAVE_EVERY END [resume] [save_on_sigterm]
  END, what the script does after its last save (no wait, no engine.destroy(), unless named):
    exit                    nothing: the interpreter exits
    destroy_process_group   torch.distributed.destroy_process_group(), as Accelerate's end_training
    destroy                 engine.destroy()
    raise                   an uncaught RuntimeError
  resume: first load the newest committed checkpoint of SAVE_DIR and train on from its step.
`JOB_END_SIGTERM_AT=STEP@RANK` in the environment: that rank sends itself SIGTERM after STEP.
Each rank writes its process id to OUT/pid_rank<r> once its engine is built.
"""

import json
import os
import signal
import sys
from pathlib import Path

import torch
from lazy_ckpt_worker import build_model, ds_config, train_step

import lazyzero
from lazyzero.testing import worker_args


def sigterm_step(rank: int) -> int | None:
    spec = os.environ.get("JOB_END_SIGTERM_AT")
    if not spec:
        return None
    step, at_rank = spec.split("@")
    return int(step) if int(at_rank) == rank else None


def main() -> None:
    out, save_dir, steps, save_every, end, *flags = worker_args()
    steps, save_every = int(steps), int(save_every)
    model = build_model()
    config = ds_config(2, save_on_sigterm="save_on_sigterm" in flags)
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    if "resume" in flags:
        engine.load_checkpoint(save_dir)
    rank, kill_after = engine.global_rank, sigterm_step(engine.global_rank)
    (Path(out) / f"pid_rank{rank}").write_text(str(os.getpid()))
    with open(Path(out) / f"losses_rank{rank}.jsonl", "a") as record:
        for step in range(engine.global_steps + 1, steps + 1):
            loss = train_step(engine, step).item()
            record.write(json.dumps({"step": step, "loss": loss}) + "\n")
            record.flush()
            if step % save_every == 0:
                engine.save_checkpoint(save_dir)
            if step == kill_after:
                os.kill(os.getpid(), signal.SIGTERM)
    if end == "destroy_process_group":
        torch.distributed.destroy_process_group()
    elif end == "destroy":
        engine.destroy()
    elif end == "raise":
        raise RuntimeError("an error of the script after its last save")
    elif end != "exit":
        sys.exit(f"unknown END {end!r}")


if __name__ == "__main__":
    main()
