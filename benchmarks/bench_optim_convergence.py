"""Does the 8-bit AdamW train as well as fp32 AdamW? The demo model, 2 ranks, 300 steps.

Two layouts, each an fp32 baseline against the 8-bit optimizer with the same seed and data:
ZeRO-2 (ds_configs/cpu_demo_zero2.json: torch AdamW, against ds_configs/cpu_demo_adam8bit.json) and
ZeRO-3 with CPU optimizer offload (ds_configs/cpu_demo_offload.json: DeepSpeed's CPU Adam, against
ds_configs/cpu_demo_adam8bit_offload.json). Figure of merit: the mean of the last 50 training
losses, 8-bit over fp32 (docs/optimizer.md target: at most 1.02 on both). Writes a plot of the curves beside
`--out`.

    python benchmarks/bench_optim_convergence.py --out benchmarks/results/bench_optim_convergence.json
    python benchmarks/bench_optim_convergence.py --quick     # 60 steps: a smoke run, not the target

Each 300-step run takes about 10 minutes on 2 CPU cores; `--runs DIR` keeps them for reuse.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import write_results  # noqa: E402
from convergence import ROOT, TAIL, parse_args, plot_panels, tail_mean, train  # noqa: E402

CONFIGS = ROOT / "ds_configs"
LAYOUTS = {
    "stage2": {"fp32": CONFIGS / "cpu_demo_zero2.json", "8bit": CONFIGS / "cpu_demo_adam8bit.json"},
    "stage3_cpu_offload": {"fp32": CONFIGS / "cpu_demo_offload.json",
                           "8bit": CONFIGS / "cpu_demo_adam8bit_offload.json"},
}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "optim_convergence")
    steps = 60 if args.quick else 300
    args.runs.mkdir(parents=True, exist_ok=True)
    ratios, details, panels = {}, {"steps": steps, "seed": args.seed, f"mean_last_{TAIL}_loss": {}}, {}
    for layout, configs in LAYOUTS.items():
        curves = {kind: train(config, args.runs / f"{layout}_{kind}_seed{args.seed}", args.seed, steps)
                  for kind, config in configs.items()}
        tails = {kind: tail_mean(values) for kind, values in curves.items()}
        ratios[f"loss_ratio_{layout}"] = tails["8bit"] / tails["fp32"]
        details[f"mean_last_{TAIL}_loss"][layout] = tails
        panels[f"{layout}: last-{TAIL} loss 8-bit/fp32 = {ratios[f'loss_ratio_{layout}']:.4f}"] = {
            f"{kind} AdamW": values for kind, values in curves.items()}
    write_results(args.out, "bench_optim_convergence", args.quick, ratios, details)
    if args.out is not None:
        plot_panels(panels, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
