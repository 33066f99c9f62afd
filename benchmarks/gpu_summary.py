"""The summary of benchmarks/gpu_checks.sh: one gpu_checks.json from each step's JSON.

    python benchmarks/gpu_summary.py --out-dir OUT --steps OUT/logs/steps.tsv [--gpu "NVIDIA H100 80GB HBM3, ..."]

Each headline key is read from one key of one step's JSON (`KEYS`). A key that cannot be read is left
out, and `missing` says why: the step's own `skipped` reason (the whole step, or that key in its
`skipped` details), how the step ended (`steps.tsv`: its exit status, seconds and limit, written by
gpu_checks.sh), or that its JSON lacks the key.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

# Headline key -> (step, key in that step's JSON).
KEYS = {
    "packing_step_time_ratio_1b": ("packing_1b", "step_time_ratio"),
    "planner_speedup_vs_zero_infinity_1b": ("planner_1b", "speedup_vs_deepspeed_default"),
    "planner_pred_error_step_time_1b": ("planner_1b", "pred_error_step_time"),
    "planner_model_flops_fraction_1b": ("planner_1b", "model_flops_fraction"),
    "checkpoint_stall_ratio_vs_deepspeed": ("checkpoint_stall", "stall_ratio_vs_deepspeed"),
    "optimizer_bandwidth_fraction": ("optimizer", "gpu_bandwidth_fraction"),
    "optimizer_speed_ratio_vs_torch_fused": ("optimizer", "gpu_speed_ratio_vs_torch_adamw_fused"),
}
TIMED_OUT = (124, 134, 137)  # timeout's own status, SIGABRT (the script's), SIGKILL


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, required=True, help="where the steps' JSON files are")
    parser.add_argument("--steps", type=Path, help="gpu_checks.sh's steps.tsv (how each step ended)")
    parser.add_argument("--gpu", default=None, help="the device, as nvidia-smi names it")
    return parser.parse_args()


def read_steps(path: Path | None) -> dict[str, dict]:
    """steps.tsv: name, exit status (or "skipped"), seconds, limit, reason; one line per step."""
    if path is None or not path.is_file():
        return {}
    steps = {}
    for line in path.read_text().splitlines():
        name, rc, seconds, limit, reason = (line.split("\t") + [""] * 5)[:5]
        steps[name] = {"status": rc if rc == "skipped" else int(rc), "seconds": int(seconds), "limit_s": int(limit),
                       **({"reason": reason} if reason else {})}
    return steps


def how_it_ended(name: str, ended: dict | None) -> str:
    if ended is None:
        return f"step {name} did not run"
    if ended["status"] == "skipped":
        return f"step {name} skipped: {ended.get('reason', '')}"
    if ended["status"] in TIMED_OUT:
        return f"step {name} stopped at its {ended['limit_s']} s limit (exit {ended['status']})"
    return f"step {name} exited {ended['status']} after {ended['seconds']} s"


def why_missing(name: str, key: str, document: dict | None, ended: dict | None) -> str:
    if document is None:
        return f"no {name}.json: {how_it_ended(name, ended)}"
    if isinstance(document.get("skipped"), str):
        return f"step {name} skipped: {document['skipped']}"
    for details in (document, *(v for v in document.values() if isinstance(v, dict))):
        skipped = details.get("skipped")
        if isinstance(skipped, dict) and key in skipped:
            return f"{name}: {skipped[key]}"
    partial = "" if ended is None or ended["status"] == 0 else f" ({how_it_ended(name, ended)})"
    return f"{name}.json has no {key!r}{partial}"


def summarize(out_dir: Path, steps: dict[str, dict], gpu: str | None = None) -> dict:
    """The summary document: each headline key found, `missing` for the others, and the steps."""
    documents = {}
    for name in {step for step, _ in KEYS.values()}:
        path = out_dir / f"{name}.json"
        try:
            documents[name] = json.loads(path.read_text()) if path.is_file() else None
        except ValueError as error:
            documents[name] = None
            steps.setdefault(name, {"status": "skipped", "seconds": 0, "limit_s": 0})["reason"] = \
                f"unreadable {path.name}: {error}"
    summary: dict = {"benchmark": "gpu_checks", "date": datetime.date.today().isoformat(), "gpu": gpu}
    missing = {}
    for headline, (name, key) in KEYS.items():
        document = documents[name]
        value = None if document is None else document.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            summary[headline] = value
        else:
            missing[headline] = why_missing(name, key, document, steps.get(name))
    summary["missing"] = missing
    summary["steps"] = steps
    return summary


def main() -> None:
    args = parse_args()
    summary = summarize(args.out_dir, read_steps(args.steps), args.gpu)
    path = args.out_dir / "gpu_checks.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    for key in KEYS:
        print(f"{key:>40}  {summary[key]:.3f}" if key in summary else f"{key:>40}  -  {summary['missing'][key]}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
