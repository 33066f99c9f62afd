"""Training entry point: `python -m lazyzero.train --deepspeed_config ds_configs/X.json --model demo`.

Runs under `deepspeed --num_gpus N` and `mpirun -n N`. Rank 0 shows a progress bar and appends one
JSON line per step to OUTPUT_DIR/metrics.jsonl; at the end every rank takes part in the evaluation
(exact-match accuracy by greedy decoding) and rank 0 writes OUTPUT_DIR/report.json and report.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from lazyzero.app.data.arithmetic import DIFFICULTIES
from lazyzero.app.model_build import ZERO_INIT_CHOICES
from lazyzero.app.trainer import Trainer, load_training_inputs
from lazyzero.config import LazyZeroConfigError, load_ds_config_file, validate_ds_config
from lazyzero.plan.deepspeed.host_memory import bound_host_heap


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lazyzero train", description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed_config", "--config", dest="deepspeed_config", required=True,
                   help="DeepSpeed JSON config (with an optional \"lazyzero\" section)")
    p.add_argument("--model", default="demo", help="preset name (tiny, demo, 125m, 1b, 7b, 13b, 27b), a real model "
                   "(smollm2-135m), a .gguf file, a config.json or a local checkpoint folder")
    p.add_argument("--family", default=None, choices=["llama", "qwen2", "mistral", "gpt2"],
                   help="architecture for a preset (default llama)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (default: a real model's own, "
                   "else byte-level; never downloaded)")
    p.add_argument("--data", default=None,
                   help="local .txt or .jsonl training file (default: the shipped arithmetic problems)")
    p.add_argument("--difficulty", default="starter", choices=list(DIFFICULTIES),
                   help="difficulty of the generated problems (train and eval)")
    p.add_argument("--train-examples", type=int, default=20000, help="generated training problems")
    p.add_argument("--eval-problems", type=int, default=64,
                   help="generated eval problems for exact-match accuracy (0: no eval)")
    p.add_argument("--eval-max-new-tokens", type=int, default=56,
                   help="decoding steps per eval prompt (the default answers need about 45)")
    p.add_argument("--eval-before", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate before training too (--no-eval-before: only after, as when comparing runs "
                        "that start from the same model)")
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--max-steps", type=int, default=150, help="optimizer steps to run")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output-dir", default=None,
                   help="metrics.jsonl, report.json and report.png go here (default runs/<config>-<model>)")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--save-dir", default=None, help="checkpoint folder (required with --save-every or --resume)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--zero-init", default="auto", choices=ZERO_INIT_CHOICES,
                   help="build the model partitioned across the ranks (ZeRO-3 only): auto does it when the whole "
                        "fp32 model is over 1 GiB (docs/plan.md, \"Planning partitioned models\")")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Reject inconsistent arguments before anything is created."""
    for name in ("max_steps", "seq_len", "train_examples"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: got {getattr(args, name)}; allowed: an integer >= 1")
    if args.save_every < 0 or args.eval_problems < 0:
        raise SystemExit("--save-every and --eval-problems must be >= 0")
    if (args.save_every or args.resume) and not args.save_dir:
        raise SystemExit("--save-every and --resume need --save-dir DIR")
    # lexists: a 'latest' that is a symbolic link reaches the load, which refuses it by name.
    if args.resume and not os.path.lexists(Path(args.save_dir) / "latest"):
        raise SystemExit(f"--resume: no checkpoint in {args.save_dir} (no 'latest' file); "
                         "run without --resume to start fresh")


def plan_for_the_run(ds_config: dict, seq_len: int, save_every: int) -> None:
    """A planned run plans for the sequences it trains on: `lazyzero.plan.seq_len` defaults to
    --seq-len, and a different value is a mistake (the plan would be made for other activations).
    With lazy checkpoints, `lazyzero.plan.checkpoint_every` defaults to --save-every."""
    section = ds_config.get("lazyzero", {})
    plan = section.get("plan")
    if not isinstance(plan, dict) or plan.get("enabled") is not True:
        return
    given = plan.setdefault("seq_len", seq_len)
    if given != seq_len:
        raise SystemExit(f"lazyzero.plan.seq_len is {given!r} but --seq-len is {seq_len}; give the same length, "
                         "or leave lazyzero.plan.seq_len out (it follows --seq-len)")
    lazy = (section.get("checkpoint") or {}).get("enabled") is True
    if save_every and lazy:
        plan.setdefault("checkpoint_every", save_every)


def bound_heap_of_planned_runs(ds_config: dict) -> None:
    """A planned run on the host bounds its heap before the model is built (docs/plan.md, "How it works", step 4):
    applied only when the planner starts, the model's parameters, freed by ZeRO-3's partitioning,
    stay in heap arenas the resident set never gives back (about 45 MB on the main job)."""
    import torch

    if ((ds_config.get("lazyzero") or {}).get("plan") or {}).get("enabled") is True and not torch.cuda.is_available():
        bound_host_heap()


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    check_args(args)
    try:
        ds_config = load_ds_config_file(args.deepspeed_config)
        plan_for_the_run(ds_config, args.seq_len, args.save_every)
        validate_ds_config(ds_config)
    except LazyZeroConfigError as err:
        print(f"lazyzero: invalid config {args.deepspeed_config}:\n{err}", file=sys.stderr)
        return 2

    bound_heap_of_planned_runs(ds_config)
    try:
        inputs = load_training_inputs(args, ds_config)
    except (ValueError, FileNotFoundError) as err:
        print(f"lazyzero: error: {err}", file=sys.stderr)
        return 2
    trainer = Trainer(args, ds_config, inputs, started=started)
    try:
        trainer.run()
    except BaseException:
        # No collective teardown: the other ranks may be inside a collective this rank left; exiting
        # with the error makes the launcher stop them.
        trainer.close_log()
        raise
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
