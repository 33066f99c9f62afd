"""Does the demo model train as well with 4-bit saved activations? 2 ranks, ZeRO-3, 300 steps.

The unquantized run (ds_configs/cpu_demo.json) against the default activation policy
(ds_configs/cpu_demo_act4.json: attention kept, norms at 8 bits, the rest at 4), same seed and data. Figure of
merit: the mean of the last 50 training losses, quantized over unquantized (docs/activations.md target: at most
1.03), with the eval accuracy (exact match on held-out problems) of both runs after training.
Writes a plot of the curves beside `--out`.

    python benchmarks/bench_activations_convergence.py --out benchmarks/results/bench_activations_convergence.json
    python benchmarks/bench_activations_convergence.py --quick     # 60 steps: a smoke run, not the target

Each 300-step run takes 10 to 20 minutes on 2 CPU cores; `--runs DIR` keeps them for reuse.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import write_results  # noqa: E402
from convergence import ROOT, TAIL, parse_args, plot_panels, tail_mean, train  # noqa: E402

CONFIGS = {"16-bit": ROOT / "ds_configs" / "cpu_demo.json", "4-bit": ROOT / "ds_configs" / "cpu_demo_act4.json"}


def eval_accuracy(run_dir: Path) -> float | None:
    report = run_dir / "report.json"
    return json.loads(report.read_text()).get("eval_accuracy_after") if report.is_file() else None


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], "activations_convergence")
    steps = 60 if args.quick else 300
    args.runs.mkdir(parents=True, exist_ok=True)
    run_dirs = {kind: args.runs / f"stage3_{kind}_seed{args.seed}" for kind in CONFIGS}
    curves = {kind: train(config, run_dirs[kind], args.seed, steps) for kind, config in CONFIGS.items()}
    tails = {kind: tail_mean(values) for kind, values in curves.items()}
    ratio = tails["4-bit"] / tails["16-bit"]
    accuracy = {kind: eval_accuracy(run_dir) for kind, run_dir in run_dirs.items()}
    details = {"steps": steps, "seed": args.seed, f"mean_last_{TAIL}_loss": tails, "eval_accuracy": accuracy}
    write_results(args.out, "bench_activations_convergence", args.quick, {"loss_ratio": ratio}, details)
    if args.out is not None:
        plot_panels({f"ZeRO-3: last-{TAIL} loss 4-bit/16-bit activations = {ratio:.4f}": {
            f"{kind} saved activations" + (" (baseline)" if kind == "16-bit" else ""): values
            for kind, values in curves.items()}}, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
