"""Build the README's benchmark table from the result files in benchmarks/results/.

    python benchmarks/readme_table.py            # print the table
    python benchmarks/readme_table.py --write    # replace the table in README.md

Each result file is what a benchmark wrote with `--out`; its numeric top-level keys become rows.
Targets are the ones the issues set; a row without one is shown for context.
"""

from __future__ import annotations

import argparse
import json
import operator
from pathlib import Path

from lazyzero.docs import replace_marked_block

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"

# benchmark -> key -> (comparison, bound), from the issue that asked for the benchmark.
TARGETS = {
    "bench_quant": {"quant_vs_memcpy": (">=", 0.5), "quant_vs_ref": (">=", 4.0)},
    "bench_grad_comm": {"wire_ratio_vs_fp32": ("<=", 0.27), "time_ratio_vs_fp32": ("<=", 0.6)},
    "bench_int8_convergence": {"loss_ratio_stage2": ("<=", 1.02), "loss_ratio_stage3": ("<=", 1.02)},
    "bench_checkpoint": {"stall_ratio_vs_deepspeed": (">=", 50.0), "e2e_overhead": ("<=", 1.05),
                         "write_bw_ratio": (">=", 0.8)},
    "bench_optim_convergence": {"loss_ratio_stage2": ("<=", 1.02), "loss_ratio_stage3_cpu_offload": ("<=", 1.02)},
    "bench_activations": {"saved_bytes_ratio": ("<=", 0.30), "peak_mem_ratio": ("<=", 0.50),
                          "step_time_ratio": ("<=", 1.15)},
    "bench_activations_convergence": {"loss_ratio": ("<=", 1.03)},
    "bench_optim": {"speed_ratio_vs_ds_cpu_adam": (">=", 1.0), "speed_ratio_vs_torch_adamw": (">=", 3.0),
                    "state_bytes_per_param": ("<=", 2.1), "clip_overhead": ("<=", 1.05)},
    "bench_planner": {"solve_s_80_layers": ("<=", 10.0), "gap_80_layers": ("<=", 0.01),
                      "pred_error_step_time": ("<=", 0.15), "pred_error_peak_mem": ("<=", 0.15),
                      "speedup_vs_fixed_rule": (">=", 1.24), "speedup_vs_deepspeed_default": (">=", 1.24),
                      "peak_over_budget_planned": ("<=", 1.1)},
}
_COMPARE = {">=": operator.ge, "<=": operator.le}


def table_markdown(results_dir: Path = RESULTS) -> str:
    rows = ["| benchmark | key | measured | target | met |", "|---|---|---|---|---|"]
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text())
        name = path.stem
        for key, value in result.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            rows.append(_row(name, key, value))
    if len(rows) == 2:
        rows.append("| (no results yet) | | | | |")
    return "\n".join(rows) + "\n"


def _row(name: str, key: str, value: float) -> str:
    target = TARGETS.get(name, {}).get(key)
    if target is None:
        return f"| {name} | `{key}` | {value:.4g} | | |"
    comparison, bound = target
    met = "yes" if _COMPARE[comparison](value, bound) else "**no**"
    return f"| {name} | `{key}` | {value:.4g} | {comparison} {bound:g} | {met} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update README.md in place")
    args = parser.parse_args()
    table = table_markdown()
    if args.write:
        README.write_text(replace_marked_block(README.read_text(), "benchmarks", table))
    else:
        print(table, end="")


if __name__ == "__main__":
    main()
