"""Does int8 gradient exchange train as well as fp32? The demo model, 2 ranks, ZeRO stages 2 and 3.

For each stage, two runs of `lazyzero.train` with the same seed and data: ds_configs/cpu_demo.json
(fp32 gradients) and ds_configs/cpu_demo_int8.json (int8, error feedback), both with the stage set.
The figure of merit is the mean of the last 50 training losses, int8 over fp32 (issue 3 target:
at most 1.02); with several `--seeds`, the ratio of the means over seeds, each seed's ratio in the
details. Writes the ratios and a plot of the curves per stage next to `--out`.

How much two runs differ without int8 is reported too: `fp32_stage3_over_stage2` compares the fp32
runs of the two stages, which compute the same training up to the order of floating-point
reductions. Training amplifies any difference, so this is the resolution of the comparison.

    python benchmarks/bench_int8_convergence.py --seeds 1234 4321 --out benchmarks/results/bench_int8_convergence.json
    python benchmarks/bench_int8_convergence.py --quick     # 60 steps: a smoke run, not the target

Each 300-step run takes 8-12 minutes on 2 CPU cores. `--runs DIR` keeps the runs there and reuses
any whose metrics already cover the requested steps.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import write_results  # noqa: E402

from lazyzero.testing import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"fp32": ROOT / "ds_configs" / "cpu_demo.json", "int8": ROOT / "ds_configs" / "cpu_demo_int8.json"}
STAGES = (2, 3)
TAIL = 50
SMOOTHING = 10


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 steps instead of 300 (smoke run)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (and the plot beside it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234], help="training seeds (data order, init)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "int8_convergence",
                        help="where the training runs go; complete runs found there are reused")
    return parser.parse_args()


def stage_config(kind: str, stage: int, runs: Path) -> Path:
    """The shipped config of `kind` at ZeRO `stage` (stage 1/2 int8 needs contiguous gradients)."""
    config = json.loads(CONFIGS[kind].read_text())
    config["zero_optimization"] = {"stage": stage, "contiguous_gradients": True}
    path = runs / f"stage{stage}_{kind}.json"
    path.write_text(json.dumps(config, indent=2))
    return path


def losses(run_dir: Path) -> list[float]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def train(kind: str, stage: int, seed: int, steps: int, runs: Path) -> Path:
    run_dir = runs / f"stage{stage}_{kind}_seed{seed}"
    if len(losses(run_dir)) >= steps:
        print(f"[convergence] reusing {run_dir}", flush=True)
        return run_dir
    print(f"[convergence] training stage {stage} {kind} seed {seed}, {steps} steps -> {run_dir}", flush=True)
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(stage_config(kind, stage, runs)),
            "--model", "demo", "--max-steps", str(steps), "--seed", str(seed), "--output-dir", str(run_dir)]
    proc = run_distributed("deepspeed", 2, argv, timeout=3600, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"training stage {stage} {kind} failed:\n{proc.stdout[-4000:]}")
    return run_dir


def smoothed(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - SMOOTHING + 1): i + 1]) / len(values[max(0, i - SMOOTHING + 1): i + 1])
            for i in range(len(values))]


def plot(curves: dict[int, dict[str, list[float]]], ratios: dict[str, float], path: Path) -> None:
    """One panel per stage; `curves[stage]` maps a label to its losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for axis, (stage, by_kind) in zip(axes[0], curves.items()):
        for label, values in by_kind.items():
            axis.plot(range(1, len(values) + 1), smoothed(values), label=label,
                      linestyle="-" if label.startswith("int8") else "--")
        axis.set_title(f"ZeRO-{stage}: last-{TAIL} loss int8/fp32 = {ratios[f'loss_ratio_stage{stage}']:.4f}")
        axis.set_xlabel("step")
        axis.set_ylabel(f"training loss (mean of {SMOOTHING})")
        axis.set_yscale("log")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    args = parse_args()
    steps = 60 if args.quick else 300
    args.runs.mkdir(parents=True, exist_ok=True)
    curves, tails = {stage: {} for stage in STAGES}, {}
    for seed in args.seeds:
        for stage in STAGES:
            for kind in CONFIGS:
                values = losses(train(kind, stage, seed, steps, args.runs))[:steps]
                curves[stage][f"{kind} gradients, seed {seed}"] = values
                tails[stage, kind, seed] = sum(values[-TAIL:]) / TAIL
    ratios, details = {}, {"steps": steps, "seeds": args.seeds, f"mean_last_{TAIL}_loss": {}}
    for stage in STAGES:
        means = {kind: sum(tails[stage, kind, seed] for seed in args.seeds) / len(args.seeds) for kind in CONFIGS}
        ratios[f"loss_ratio_stage{stage}"] = means["int8"] / means["fp32"]
        details[f"mean_last_{TAIL}_loss"][f"stage{stage}"] = {
            f"{kind}_seed{seed}": tails[stage, kind, seed] for kind in CONFIGS for seed in args.seeds}
        details[f"loss_ratio_stage{stage}_per_seed"] = {
            str(seed): tails[stage, "int8", seed] / tails[stage, "fp32", seed] for seed in args.seeds}
    fp32 = {stage: sum(tails[stage, "fp32", seed] for seed in args.seeds) for stage in STAGES}
    ratios["fp32_stage3_over_stage2"] = fp32[3] / fp32[2]
    write_results(args.out, "bench_int8_convergence", args.quick, ratios, details)
    if args.out is not None:
        plot(curves, ratios, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
