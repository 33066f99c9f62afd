"""Does int8 gradient exchange train as well as fp32? The demo model, 2 ranks, ZeRO stages 2 and 3.

For each stage, two runs of `lazyzero.train` with the same seed and data: ds_configs/cpu_demo.json
(fp32 gradients) and ds_configs/cpu_demo_int8.json (int8, error feedback), both with the stage set.
The figure of merit is the mean of the last 50 training losses, int8 over fp32 (docs/gradients.md target:
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
from convergence import ROOT, TAIL, plot_panels, train  # noqa: E402

CONFIGS = {"fp32": ROOT / "ds_configs" / "cpu_demo.json", "int8": ROOT / "ds_configs" / "cpu_demo_int8.json"}
STAGES = (2, 3)


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


def train_kind(kind: str, stage: int, seed: int, steps: int, runs: Path) -> list[float]:
    return train(stage_config(kind, stage, runs), runs / f"stage{stage}_{kind}_seed{seed}", seed, steps)


def main() -> None:
    args = parse_args()
    steps = 60 if args.quick else 300
    args.runs.mkdir(parents=True, exist_ok=True)
    curves, tails = {stage: {} for stage in STAGES}, {}
    for seed in args.seeds:
        for stage in STAGES:
            for kind in CONFIGS:
                values = train_kind(kind, stage, seed, steps, args.runs)
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
        panels = {f"ZeRO-{stage}: last-{TAIL} loss int8/fp32 = {ratios[f'loss_ratio_stage{stage}']:.4f}": curves[stage]
                  for stage in STAGES}
        plot_panels(panels, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
