"""`lazyzero` command line: `train`, `plan`, `profile`, `config check|reference`, `ops build|status`,
`ckpt ls|verify|export`, `env`.

Later capabilities (profile) add their own sub-commands here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from lazyzero.app.environment import environment_report, format_report
from lazyzero.checkpoint.commands import add_ckpt_commands
from lazyzero.config.errors import LazyZeroConfigError
from lazyzero.config.trainer_values import trainer_filled_keys
from lazyzero.docs import replace_marked_block
from lazyzero.plan.commands import add_plan_command
from lazyzero.plan.profile.summary import profile_table


def _config_check(args: argparse.Namespace) -> int:
    from lazyzero.config.reference import format_config_summary
    from lazyzero.config.validate import check_config_file, load_ds_config_file

    status = 0
    for path in args.files:
        try:
            cfg = check_config_file(path, world_size=args.world_size)
        except LazyZeroConfigError as err:
            print(f"{path}: INVALID\n{err}", file=sys.stderr)
            status = 2
            continue
        print(f"{path}: OK\n{format_config_summary(cfg)}")
        unchecked = trainer_filled_keys(load_ds_config_file(path))
        if unchecked:
            print(f"not checked, \"auto\" (the Hugging Face Trainer or Accelerate fills them in before "
                  f"deepspeed.initialize): {', '.join(unchecked)}")
    return status


def _config_reference(args: argparse.Namespace) -> int:
    from lazyzero.config.reference import config_reference_markdown

    reference = config_reference_markdown()
    if args.write is None:
        print(reference, end="")
        return 0
    page = Path(args.write)
    page.write_text(replace_marked_block(page.read_text(), "config-reference", reference))
    print(f"updated the config reference in {page}")
    return 0


def _ops_build(args: argparse.Namespace) -> int:
    from lazyzero.ops import deepspeed_ops, native_build

    statuses = native_build.build(verbose=not args.quiet) + deepspeed_ops.build_run_ops(verbose=not args.quiet)
    print(native_build.format_status(statuses))
    return 1 if any(s.state == "failed" for s in statuses) else 0


def _ops_status(args: argparse.Namespace) -> int:
    from lazyzero.ops import native_build

    print(native_build.format_status(native_build.status()))
    return 0


def _train(args: argparse.Namespace, rest: list[str]) -> int:
    from lazyzero.train import main as train_main

    return train_main(rest)


def _profile(args: argparse.Namespace) -> int:
    import torch

    from lazyzero.app.data.tokenizer import load_tokenizer
    from lazyzero.config.validate import load_ds_config_file
    from lazyzero.models.build import build_model
    from lazyzero.plan.profile.profiler import ProfileFileError, ProfileSettings, load_or_profile

    measured = []
    try:
        ds_config = load_ds_config_file(args.deepspeed_config) if args.deepspeed_config else None
        tokenizer = load_tokenizer(None)  # the byte tokenizer `lazyzero train` uses by default
        model = build_model(args.model, family=args.family, vocab_size=tokenizer.vocab_size,
                            dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype],
                            max_positions=max(args.seq, 256))
        profile = load_or_profile(args.out, model, micro_batch=args.micro_batch, seq_len=args.seq, nvme_path=args.nvme,
                                  ds_config=ds_config, settings=ProfileSettings(repeats=args.repeats),
                                  log=lambda line: (measured.append(line), print(line, file=sys.stderr)))
    except (ValueError, OSError, LazyZeroConfigError, ProfileFileError) as error:
        print(f"lazyzero profile: {error}", file=sys.stderr)
        return 2
    print(profile_table(profile), end="")
    print(f"wrote {args.out}" if measured else f"reused {args.out} (same model, run shape and machine)")
    return 0


def _add_profile_command(sub) -> None:
    profile = sub.add_parser("profile",
                             help="measure per-layer costs and machine speeds for the planner (cached in a file)")
    profile.add_argument("--model", required=True, help="preset name, a config.json or a local checkpoint folder")
    profile.add_argument("--family", default=None, choices=["llama", "qwen2", "mistral", "gpt2"],
                         help="architecture for a preset (default llama)")
    profile.add_argument("--micro-batch", type=int, required=True, help="micro-batch size per rank")
    profile.add_argument("--seq", type=int, required=True, help="sequence length")
    profile.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="parameter and activation dtype")
    profile.add_argument("--nvme", metavar="PATH", default=None, help="folder whose NVMe write/read speed to measure")
    profile.add_argument("--deepspeed_config", metavar="FILE", default=None,
                         help="DeepSpeed config whose \"aio\" section to use")
    profile.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the median is kept)")
    profile.add_argument("--out", required=True, metavar="FILE",
                         help="profile JSON (reused when model and machine match)")
    profile.set_defaults(func=_profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazyzero",
                                     description="DeepSpeed ZeRO, planned, quantized and checkpointed lazily.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train a model (all arguments go to python -m lazyzero.train; see --help)",
                   add_help=False)

    add_plan_command(sub)
    _add_profile_command(sub)

    config = sub.add_parser("config", help="validate configs or print the config reference").add_subparsers(
        dest="action", required=True)
    check = config.add_parser("check", help="validate DeepSpeed JSON files with a \"lazyzero\" section")
    check.add_argument("files", nargs="+")
    check.add_argument("--world-size", type=int, default=None,
                       help="also check settings that depend on the number of ranks")
    check.set_defaults(func=_config_check)
    reference = config.add_parser("reference", help="print the \"lazyzero\" config reference (Markdown)")
    reference.add_argument("--write", metavar="FILE", default=None,
                           help="replace the block between the config-reference markers in FILE (docs/config.md) "
                                "instead")
    reference.set_defaults(func=_config_reference)

    ops = sub.add_parser("ops", help="build or inspect the native ops").add_subparsers(dest="action", required=True)
    ops_build = ops.add_parser("build", help="compile the C++ (and, with a GPU, CUDA) kernels now, "
                                                  "and the DeepSpeed ops runs load")
    ops_build.add_argument("--quiet", action="store_true")
    ops_build.set_defaults(func=_ops_build)
    ops.add_parser("status", help="which backends are built, and if not, why").set_defaults(func=_ops_status)

    ckpt = sub.add_parser("ckpt", help="list, verify or export lazyzero checkpoints").add_subparsers(
        dest="action", required=True)
    add_ckpt_commands(ckpt)
    env = sub.add_parser("env", help="versions, native ops, DeepSpeed internals, NVMe, MPI, accelerators "
                                     "and background priority (for bug reports)")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(func=_env)
    return parser


def _env(args: argparse.Namespace) -> int:
    # DeepSpeed logs to the stdout it finds at import (its accelerator notice): keep that off the report.
    with contextlib.redirect_stdout(sys.stderr):
        report = environment_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        return _train(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
