"""What the least per-rank budget with a plan consists of (docs/finetune.md, "The floor").

Rebuilds a planned run's problem from its cached profile and DeepSpeed config, as the run does (the
int8 decision; the process's own memory from `--process-gb`, else the profile's snapshot at its
start, which can differ from what the run measured: 0.67 against 0.40 GB for SmolLM2), finds the
least compute-memory capacity with a plan and splits that plan's predicted peak into its parts: the
process, DeepSpeed's workspace and swappers (calibrated), what the lazyzero features hold whatever
the plan, the lazy checkpoint's snapshot, and the layers' tensors.

    python benchmarks/plan_floor.py --profile ~/.cache/lazyzero/profiles/<file>.json \
        --config runs/bench_end_to_end/round1/planned/ds_config.json --ranks 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lazyzero.config import validate_ds_config
from lazyzero.plan.deepspeed.calibrate import headroom_budget, with_compute_capacity
from lazyzero.plan.deepspeed.engine_setup import rounded_process_bytes
from lazyzero.plan.deepspeed.priced_gradients import int8_gradients_priced
from lazyzero.plan.deepspeed.problem_from_profile import feature_workspace_bytes, problem_for_config, rank_shape
from lazyzero.plan.profile.profiler import read_profile
from lazyzero.plan.solver.milp import solve

GB = 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True, help="the run's profile file")
    parser.add_argument("--config", type=Path, required=True, help="the run's DeepSpeed config (with its plan section)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the run, all on this node")
    parser.add_argument("--process-gb", type=float,
                        help="the process's own memory in the run (the run does not print it: take the value "
                             "that reproduces its least budget); default: the profile's snapshot at its start")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    profile = read_profile(args.profile)
    ds_config = json.loads(args.config.read_text())
    settings = validate_ds_config(ds_config, world_size=args.ranks).plan
    ds_config, decision = int8_gradients_priced(profile, ds_config, settings)
    process = rounded_process_bytes(profile.memory.rss_bytes - profile.memory.param_bytes if args.process_gb is None
                                    else round(args.process_gb * GB))
    settings = settings.model_copy(update={"headroom_share": None})
    problem, _ = problem_for_config(profile, ds_config, settings, args.ranks, args.ranks, process_bytes=process)
    least = headroom_budget(problem, 0.0).least_bytes
    plan = solve(with_compute_capacity(problem, least), time_limit_s=settings.time_limit_s, max_gap=settings.max_gap)
    features = feature_workspace_bytes(profile, ds_config, rank_shape(ds_config, settings, args.ranks))
    snapshot = problem.snapshot_held(plan.layers)
    peak = plan.predicted_peak_bytes["gpu"]
    parts = {
        "the process before the engine, rounded up to 64 MiB": process,
        "DeepSpeed's workspace and optimizer swapper (calibrated)": problem.workspace_bytes - process - features,
        "lazyzero features held whatever the plan (int8 exchange)": features,
        "a lazy checkpoint's snapshot": snapshot,
        "DeepSpeed's parameter swapper": problem.param_swap_held(plan.layers),
    }
    parts["the layers' tensors at the peak window (parameters, gradients, states, activations)"] = \
        peak - sum(parts.values())
    print(decision or "int8 gradients as configured")
    for name, nbytes in parts.items():
        print(f"{nbytes / GB:6.2f} GB  {name}")
    print(f"{peak / GB:6.2f} GB  predicted peak of the least plan (capacity {least / GB:.2f} GB; "
          f"per-rank budget {least / (1 - settings.memory_reserve) / GB:.2f} GB after memory_reserve)")


if __name__ == "__main__":
    main()
