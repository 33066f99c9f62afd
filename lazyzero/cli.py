"""`lazyzero` command line: `train`, `plan`, `config check|reference`, `ops build|status`, `ckpt ls|verify|export`.

Later capabilities (profile) add their own sub-commands here.
"""

from __future__ import annotations

import argparse
import sys


def _config_check(args: argparse.Namespace) -> int:
    from lazyzero.config import LazyZeroConfigError, check_config_file, format_config_summary

    status = 0
    for path in args.files:
        try:
            cfg = check_config_file(path, world_size=args.world_size)
        except LazyZeroConfigError as err:
            print(f"{path}: INVALID\n{err}", file=sys.stderr)
            status = 2
            continue
        print(f"{path}: OK\n{format_config_summary(cfg)}")
    return status


def _config_reference(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lazyzero.config import config_reference_markdown
    from lazyzero.docs import replace_marked_block

    reference = config_reference_markdown()
    if args.write_readme is None:
        print(reference, end="")
        return 0
    readme = Path(args.write_readme)
    readme.write_text(replace_marked_block(readme.read_text(), "config-reference", reference))
    print(f"updated the config reference in {readme}")
    return 0


def _ops_build(args: argparse.Namespace) -> int:
    from lazyzero.ops import build

    statuses = build.build(verbose=not args.quiet)
    print(build.format_status(statuses))
    return 1 if any(s.state == "failed" for s in statuses) else 0


def _ops_status(args: argparse.Namespace) -> int:
    from lazyzero.ops import build

    print(build.format_status(build.status()))
    return 0


def _train(args: argparse.Namespace, rest: list[str]) -> int:
    from lazyzero.train import main as train_main

    return train_main(rest)


def _memory_size(text: str) -> int:
    from lazyzero.config import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lazyzero.planner import PlanInfeasible, SolverFoundNoPlan, greedy_plan, solve
    from lazyzero.planner.costs import problem_from_preset
    from lazyzero.planner.report import baseline_step_times, plan_table

    try:
        problem = problem_from_preset(
            args.model, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, nvme_path=args.nvme, seq=args.seq,
            micro_batch=args.micro_batch, gpu_tflops=args.gpu_tflops, h2d_gbps=args.h2d_gbps,
            d2h_gbps=args.d2h_gbps, nvme_read_gbps=args.nvme_read_gbps, nvme_write_gbps=args.nvme_write_gbps)
    except (ValueError, OSError) as error:
        print(f"lazyzero plan: {error}", file=sys.stderr)
        return 2
    try:
        greedy = greedy_plan(problem)
    except PlanInfeasible:
        greedy = None  # the MILP may still find a plan; if not, it names the binding budget
    try:
        with Console(stderr=True).status(f"solving the MILP for {args.model} (time limit {args.time_limit:g} s)"):
            plan = solve(problem, time_limit_s=args.time_limit, max_gap=args.max_gap, warm_start=greedy)
    except PlanInfeasible as error:
        print(f"lazyzero plan: infeasible budget for tier(s) {', '.join(error.tiers)}: {error}", file=sys.stderr)
        return 2
    except SolverFoundNoPlan as error:
        print(f"lazyzero plan: {error}; try a longer --time-limit", file=sys.stderr)
        return 1
    print(plan_table(problem, plan), end="")
    print("baselines (predicted step time):")
    for name, result in baseline_step_times(problem, greedy).items():
        print(f"  {name}: {result}")
    _write_plan_outputs(args, problem, plan)
    return 0


def _write_plan_outputs(args: argparse.Namespace, problem, plan) -> None:
    """DIR/plan.json, DIR/ds_config.json (the DeepSpeed config the plan implies), DIR/memory.png."""
    import json
    from pathlib import Path

    from lazyzero.planner.report import DEFAULT_BASE_CONFIG, implied_ds_config, plot_memory

    out = Path(args.out or f"plan-{args.model}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(plan.to_json())
    base = {**DEFAULT_BASE_CONFIG, "train_micro_batch_size_per_gpu": args.micro_batch}
    # Absolute, so that the config means the same folder wherever training is started from.
    nvme_path = None if args.nvme is None else str(Path(args.nvme).resolve())
    ds_config = implied_ds_config(problem, plan, base, nvme_path=nvme_path)
    (out / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    plot_memory(problem, plan, out / "memory.png")
    print(f"wrote {out / 'plan.json'}, {out / 'ds_config.json'}, {out / 'memory.png'}")


def _add_plan_command(sub) -> None:
    from lazyzero.models.presets import PRESETS

    plan = sub.add_parser("plan", help="plan memory placement and precision for a model preset (analytic costs)")
    plan.add_argument("--model", required=True, choices=sorted(PRESETS), help="model preset")
    plan.add_argument("--gpu-mem", required=True, type=_memory_size, help="GPU memory budget, e.g. 70GB")
    plan.add_argument("--cpu-mem", type=_memory_size, default=None, help="host memory budget (default: total RAM)")
    plan.add_argument("--nvme", metavar="PATH", default=None, help="folder on NVMe to spill to (its free space is the budget)")
    plan.add_argument("--seq", type=int, default=4096, help="sequence length")
    plan.add_argument("--micro-batch", type=int, default=1, help="micro-batch size per GPU")
    plan.add_argument("--gpu-tflops", type=float, default=400, help="sustained bf16 TFLOP/s of the GPU")
    plan.add_argument("--h2d-gbps", type=float, default=25, help="host-to-device GB/s")
    plan.add_argument("--d2h-gbps", type=float, default=25, help="device-to-host GB/s")
    plan.add_argument("--nvme-read-gbps", type=float, default=3, help="NVMe read GB/s")
    plan.add_argument("--nvme-write-gbps", type=float, default=2, help="NVMe write GB/s")
    plan.add_argument("--time-limit", type=float, default=10, help="MILP solver time limit in seconds")
    plan.add_argument("--max-gap", type=float, default=0.01, help="relative optimality gap at which the solver stops")
    plan.add_argument("--out", metavar="DIR", default=None, help="output folder (default: ./plan-PRESET)")
    plan.set_defaults(func=_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazyzero", description="DeepSpeed ZeRO, planned, quantized and checkpointed lazily.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train a model (all arguments go to python -m lazyzero.train; see --help)", add_help=False)
    _add_plan_command(sub)

    config = sub.add_parser("config", help="validate configs or print the config reference").add_subparsers(dest="action", required=True)
    check = config.add_parser("check", help="validate DeepSpeed JSON files with a \"lazyzero\" section")
    check.add_argument("files", nargs="+")
    check.add_argument("--world-size", type=int, default=None, help="also check settings that depend on the number of ranks")
    check.set_defaults(func=_config_check)
    reference = config.add_parser("reference", help="print the \"lazyzero\" config reference (Markdown)")
    reference.add_argument("--write-readme", metavar="README", default=None, help="replace the reference block in this file instead")
    reference.set_defaults(func=_config_reference)

    ops = sub.add_parser("ops", help="build or inspect the native ops").add_subparsers(dest="action", required=True)
    ops_build = ops.add_parser("build", help="compile the C++ (and, with a GPU, CUDA) kernels now")
    ops_build.add_argument("--quiet", action="store_true")
    ops_build.set_defaults(func=_ops_build)
    ops.add_parser("status", help="which backends are built, and if not, why").set_defaults(func=_ops_status)

    from lazyzero.checkpoint.cli import add_ckpt_commands

    ckpt = sub.add_parser("ckpt", help="list, verify or export lazyzero checkpoints").add_subparsers(dest="action", required=True)
    add_ckpt_commands(ckpt)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        return _train(argparse.Namespace(), argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
