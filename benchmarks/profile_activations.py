"""Where a packed training step's time goes: the plain step against the default policy's, per preset.

For each preset: the median of interleaved steps of each (`common.median_seconds`), the peak memory above
the step's floor on a GPU, and with `--profile` one profiled step of each, its operators by self
time (GPU and host). On a GPU a step whose summed kernel time is far below its wall time is set by
the host's launches and waits, not by the kernels (docs/activations.md, "On a GPU").

    python benchmarks/profile_activations.py                   # demo 8 x 512; on a GPU also 1b 4 x 2048
    python benchmarks/profile_activations.py --profile --runs demo:512:8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_activations sits beside this script
from bench_activations import POLICIES, Trainee  # noqa: E402
from common import median_seconds  # noqa: E402

CASES = {"baseline": None, "default": POLICIES["default"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", help="PRESET:SEQ:BATCH each (default: demo:512:8, and 1b:2048:4 on a GPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps of each case")
    parser.add_argument("--profile", action="store_true", help="also print one profiled step of each case")
    return parser.parse_args()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_above_floor(trainee: Trainee, config) -> int | None:
    """Bytes the step allocates above what is live before it (GPU only: the caching allocator counts)."""
    if not torch.cuda.is_available():
        return None
    synchronize()
    torch.cuda.reset_peak_memory_stats()
    floor = torch.cuda.memory_allocated()
    trainee.step(config)
    synchronize()
    return torch.cuda.max_memory_allocated() - floor


def print_profile(trainee: Trainee, name: str, config) -> None:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        trainee.step(config)
        synchronize()
    averages = prof.key_averages()
    # The kernels' time is the tables' "Self CUDA time total" line.
    print(f"-- {name}: {sum(event.count for event in averages)} profiled events")
    keys = ["self_cpu_time_total"] + (["self_cuda_time_total"] if torch.cuda.is_available() else [])
    for key in keys:
        print(averages.table(sort_by=key, row_limit=14, max_name_column_width=60))


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runs = args.runs or (["demo:512:8", "1b:2048:4"] if device.type == "cuda" else ["demo:512:8"])
    for run in runs:
        preset, seq, batch = run.split(":")
        trainee = Trainee.from_preset(preset, int(seq), int(batch), device)
        for config in CASES.values():
            trainee.step(config)  # warm-up: optimizer state, kernels, allocator
        peaks = {name: peak_above_floor(trainee, config) for name, config in CASES.items()}
        median = median_seconds({name: (lambda config=config, trainee=trainee: trainee.step(config))
                                 for name, config in CASES.items()}, args.repeats)
        print(f"== {preset} {batch} x {seq}: median step {median['baseline']:.4f} s plain, {median['default']:.4f} s "
              f"default: {median['default'] / median['baseline']:.3f} x", flush=True)
        if peaks["baseline"]:
            plain_mib, default_mib = peaks["baseline"] / 2**20, peaks["default"] / 2**20
            print(f"   peak above the floor: {plain_mib:.0f} MiB plain, {default_mib:.0f} MiB default: "
                  f"{default_mib / plain_mib:.3f}", flush=True)
        if args.profile:
            for name, config in CASES.items():
                print_profile(trainee, f"{preset} {name}", config)
        del trainee
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
