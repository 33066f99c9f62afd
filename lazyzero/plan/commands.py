"""`lazyzero plan` (docs/plan.md): can this model train on this machine, and how fast?

From a model preset with analytic costs (`--model 7b --gpu-mem 24GB ...`, `deepspeed/costs.py`), or from a
measured profile (`--profile profile.json`, written by `lazyzero profile` or by a planned run; the
run shape, dtype and ranks come from the profile). Prints the plan per layer, the predicted peak
per tier and step time, the solve time and gap and the baselines; writes plan.json, the DeepSpeed
config the plan implies and memory.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lazyzero.config.memory import parse_memory_size
from lazyzero.models.presets import PRESETS
from lazyzero.plan.config import PlanConfig
from lazyzero.plan.deepspeed.costs import problem_from_preset
from lazyzero.plan.deepspeed.implied import DEFAULT_BASE_CONFIG, PlanNotExpressible, implied_setup
from lazyzero.plan.deepspeed.problem_from_profile import Budgets, RankShape, problem_from_profile, uses_torch_adam
from lazyzero.plan.report import baseline_step_times, plan_table, plot_memory
from lazyzero.plan.solver.greedy import greedy_plan
from lazyzero.plan.solver.problem import PlanInfeasible


def _memory_size(text: str) -> int:
    try:
        return parse_memory_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_plan_command(sub) -> None:
    plan = sub.add_parser("plan", help="plan memory placement and precision (from a preset or a measured profile)")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(PRESETS), help="model preset (analytic costs)")
    source.add_argument("--profile", metavar="FILE", help="measured profile (lazyzero profile, or a planned run's)")
    plan.add_argument("--gpu-mem", type=_memory_size, default=None,
                      help="GPU memory budget per rank, e.g. 70GB "
                           "(needed unless the profile is from a machine without a GPU)")
    plan.add_argument("--cpu-mem", type=_memory_size, default=None,
                      help="host memory budget per node (default: total RAM)")
    plan.add_argument("--nvme", metavar="PATH", default=None,
                      help="folder on NVMe to spill to (its free space is the budget)")
    plan.add_argument("--ranks-per-node", type=int, default=None,
                      help="with --profile: ranks sharing the host budget (default: the profile's world size)")
    plan.add_argument("--seq", type=int, default=4096, help="sequence length (presets)")
    plan.add_argument("--micro-batch", type=int, default=1, help="micro-batch size per GPU (presets)")
    plan.add_argument("--gpu-tflops", type=float, default=400, help="sustained bf16 TFLOP/s of the GPU (presets)")
    plan.add_argument("--h2d-gbps", type=float, default=25, help="host-to-device GB/s (presets)")
    plan.add_argument("--d2h-gbps", type=float, default=25, help="device-to-host GB/s (presets)")
    plan.add_argument("--nvme-read-gbps", type=float, default=3, help="NVMe read GB/s (presets)")
    plan.add_argument("--nvme-write-gbps", type=float, default=2, help="NVMe write GB/s (presets)")
    plan.add_argument("--max-grad-error", type=float, default=PlanConfig().max_grad_error,
                      help="with --profile: widths whose measured gradient error on a layer exceeds this are not "
                           "given to it (lazyzero.plan.max_grad_error; default %(default)s)")
    plan.add_argument("--time-limit", type=float, default=10, help="MILP solver time limit in seconds")
    plan.add_argument("--max-gap", type=float, default=0.01, help="relative optimality gap at which the solver stops")
    plan.add_argument("--out", metavar="DIR", default=None, help="output folder (default: ./plan-PRESET or ./plan)")
    plan.set_defaults(func=run_plan_command)


def run_plan_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from lazyzero.plan.profile.profiler import ProfileFileError
    from lazyzero.plan.solver.milp import SolverFoundNoPlan, solve

    try:
        problem, sizes, base = _problem(args)
    except (ValueError, OSError, ProfileFileError) as error:
        print(f"lazyzero plan: {error}", file=sys.stderr)
        return 2
    try:
        greedy = greedy_plan(problem)
    except PlanInfeasible:
        greedy = None  # the MILP may still find a plan; if not, it names the binding budget
    try:
        with Console(stderr=True).status(f"solving the MILP ({problem.num_layers} layers, "
                                         f"limit {args.time_limit:g} s)"):
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
    try:
        _write_outputs(args, problem, plan, sizes, base)
    except PlanNotExpressible as error:
        print(f"lazyzero plan: {error}", file=sys.stderr)
        return 1
    return 0


def _problem(args: argparse.Namespace):
    """(problem, model sizes or None, base DeepSpeed config) from the preset or the profile."""
    if args.profile is None:
        if args.gpu_mem is None:
            raise ValueError("--gpu-mem is needed with --model (a preset is planned for one GPU)")
        problem = problem_from_preset(
            args.model, gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, nvme_path=args.nvme, seq=args.seq,
            micro_batch=args.micro_batch, gpu_tflops=args.gpu_tflops, h2d_gbps=args.h2d_gbps,
            d2h_gbps=args.d2h_gbps, nvme_read_gbps=args.nvme_read_gbps, nvme_write_gbps=args.nvme_write_gbps)
        return problem, None, {**DEFAULT_BASE_CONFIG, "train_micro_batch_size_per_gpu": args.micro_batch}
    from lazyzero.plan.profile.profiler import read_profile

    profile = read_profile(args.profile)
    shape = profile.fingerprint
    ranks = args.ranks_per_node or shape.world_size
    if args.max_grad_error <= 0:
        raise ValueError(f"--max-grad-error: must be > 0, got {args.max_grad_error}")
    problem, sizes = problem_from_profile(profile, Budgets(args.cpu_mem, args.gpu_mem, args.nvme, ranks),
                                          RankShape(shape.world_size, shape.dtype, shape.dtype != "float32", True,
                                                    _engines_use_torch_adam(profile)),
                                          max_grad_error=args.max_grad_error)
    base = {"train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1}
    if shape.dtype != "float32":
        base["bf16" if shape.dtype == "bfloat16" else "fp16"] = {"enabled": True}
    return problem, sizes, base


def _engines_use_torch_adam(profile) -> bool:
    """Whether the profile's calibration engines stepped torch's AdamW: the run they were measured for
    does (its config's optimizer section is theirs, implied.calibration_ds_config)."""
    return profile.engine is not None and uses_torch_adam(profile.engine.config)


def _write_outputs(args: argparse.Namespace, problem, plan, sizes, base: dict) -> None:
    """DIR/plan.json, DIR/ds_config.json (the DeepSpeed config the plan implies), DIR/memory.png."""
    out = Path(args.out or (f"plan-{args.model}" if args.model else "plan"))
    # Absolute, so that the config means the same folder wherever training is started from.
    nvme_path = None if args.nvme is None else str(Path(args.nvme).resolve())
    setup = implied_setup(problem, plan, base, nvme_path=nvme_path, sizes=sizes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(plan.to_json())
    (out / "ds_config.json").write_text(json.dumps(setup.ds_config, indent=2) + "\n")
    plot_memory(problem, plan, out / "memory.png")
    print(f"wrote {out / 'plan.json'}, {out / 'ds_config.json'}, {out / 'memory.png'}")
    if setup.optimizer_nvme_layers:
        print(f"optimizer state on NVMe for {len(setup.optimizer_nvme_layers)} of {problem.num_layers} layers: "
              "a planned run (lazyzero.plan.enabled) swaps only those; this DeepSpeed config alone swaps all")
