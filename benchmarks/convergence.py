"""Shared by the convergence benchmarks: train the demo model with `lazyzero.train` on 2 ranks,
read its losses, compare tails, plot curves.

Runs go to a folder per (name, seed); a run whose metrics already cover the requested steps is
reused, so an interrupted benchmark resumes and baselines are shared between runs of a script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TAIL = 50
SMOOTHING = 10


def parse_args(description: str, runs_name: str) -> argparse.Namespace:
    """--quick (60 steps), --out, --seed and --runs (default runs/<runs_name>) of a convergence benchmark."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="60 steps instead of 300 (smoke run)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (and the plot beside it)")
    parser.add_argument("--seed", type=int, default=1234, help="training seed (data order, init)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / runs_name,
                        help="where the training runs go; complete runs found there are reused")
    return parser.parse_args()


def losses(run_dir: Path) -> list[float]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return []
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def train(config: Path, run_dir: Path, seed: int, steps: int) -> list[float]:
    """The first `steps` training losses of the demo model under `config` (trained unless reusable)."""
    if len(losses(run_dir)) >= steps:
        print(f"[convergence] reusing {run_dir}", flush=True)
        return losses(run_dir)[:steps]
    print(f"[convergence] training {config.name} seed {seed}, {steps} steps -> {run_dir}", flush=True)
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(config), "--model", "demo",
            "--max-steps", str(steps), "--seed", str(seed), "--output-dir", str(run_dir)]
    proc = run_distributed("deepspeed", 2, argv, timeout=3600, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"training with {config} failed:\n{proc.stdout[-4000:]}")
    return losses(run_dir)[:steps]


def tail_mean(values: list[float]) -> float:
    return sum(values[-TAIL:]) / len(values[-TAIL:])


def smoothed(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - SMOOTHING + 1): i + 1]) / len(values[max(0, i - SMOOTHING + 1): i + 1])
            for i in range(len(values))]


def plot_panels(panels: dict[str, dict[str, list[float]]], path: Path) -> None:
    """One panel per title; each maps a curve label to its losses (dashed when it names a baseline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (title, curves) in zip(axes[0], panels.items()):
        for label, values in curves.items():
            axis.plot(range(1, len(values) + 1), smoothed(values), label=label,
                      linestyle="--" if "fp32" in label or "baseline" in label else "-")
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.set_ylabel(f"training loss (mean of {SMOOTHING})")
        axis.set_yscale("log")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")
