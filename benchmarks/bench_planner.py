"""The memory planner against its baselines under one host-memory budget (docs/plan.md).

    python benchmarks/bench_planner.py --quick --out benchmarks/results/bench_planner.json
    python benchmarks/bench_planner.py --profile-only --out /tmp/bench_planner_profile.json   # one part alone

1. `solve_s_80_layers`: the MILP on an 80-layer instance (`lazyzero.plan.solver.instances`), with its gap.
2. One model whose full training state does not fit the budget (a 103M-parameter Llama in bf16 on 2
   CPU ranks, ZeRO-3) is trained three times by `lazyzero train`, each under the same per-rank budget
   and allocator settings (`lazyzero.plan.deepspeed.host_memory`):
   - lazyzero's plan (`"plan": {"enabled": true}`: profiled at start, solved, applied, compared with
     what the run measures after 3 steps and planned again if off by more than 15%);
   - LazyTrain's fixed rule (every 4th layer keeps its activations, offloaded, the others recompute;
     parameters and fp32 optimizer state offloaded: to NVMe on this machine, which has no other tier);
   - DeepSpeed's default ZeRO-Infinity offload (parameters and fp32 optimizer state on NVMe, nothing
     recomputed), plain DeepSpeed settings and no lazyzero feature.
   The baselines' configs are what `lazyzero.plan.deepspeed.implied` makes of `fixed_rule_plan` and
   `deepspeed_default_plan` for the planned run's own problem (same profile, same budget).
   The three are trained in ROUNDS rounds (2 with --quick), each round in another order, so that a
   slow spell of the machine or its disk (20-30% drift within minutes here) falls on every config
   rather than on one. Every run swaps into an NVMe folder of its own, emptied and synced to disk
   after it, so that no run pays for the previous run's writes.
Keys: `pred_error_step_time` and `pred_error_peak_mem` (|measured / predicted - 1| of the first
round's first plan, before any measurement of that run; `*_replanned` the same for the plan in force
at its last comparison), `speedup_vs_fixed_rule` and `speedup_vs_deepspeed_default` (the baseline's
median step time over the plan's, each median over the timed steps of every round: steps after the
warm-up and, for the plan, after the re-planning; the details give each round's ratios), and each
run's peak resident set (whole process lifetime, profiling included) over the budget.
3. `profile_peak_rss_over_model_bytes`: the same architecture, PROFILE_LAYERS deep, built partitioned
   across the 2 ranks as it is created (`build_model(zero_init_config=...)`) and profiled as a planned
   run profiles (`planner_profile_worker.py`): the largest rise of a rank's resident set while
   profiling, over the whole model's parameter bytes. Below 1: no rank held the whole model for
   planning. The rise does not grow with depth (one layer is whole at a time), but the profiler's
   own working set (about 0.4 GB here: one layer's collectives and gradient-error buffers, the
   optimizer and copy tests, libraries loaded on first use) exceeds the 8-layer model's 0.2 GB, so
   the figure is taken on a model deep enough for the model to be what is measured; the details keep
   each phase's rise. `--profile-only` measures just this.
4. A run larger than memory, after the compared runs (its NVMe traffic then precedes none of them):
   the `1b` preset (1.1B parameters, built partitioned by `lazyzero train`) through the planner under
   `ds_configs/cpu_1b_planned.json` (a budget 5% of the way from the least that admits a plan to the
   all-in-memory peak, NVMe at `--nvme`). Keys:
   `larger_than_memory_state_over_budget` (the run's whole training state, counted as mixed-precision
   Adam's 16 bytes per parameter, over the per-rank budget; the details also give each rank's share
   over its budget, `state_per_rank_over_budget`), `larger_than_memory_pred_error_step_time` and
   `..._peak_mem` (the first plan's check). `--larger-than-memory-only` runs just this.

`--gpu` (benchmarks/gpu_checks.sh) runs none of the above: the `1b` preset on one GPU under
`ds_configs/gpu_1b_planned_80gb.json` (a GPU budget well below its training state), then DeepSpeed's
default ZeRO-Infinity offload of the same problem (`deepspeed_default_plan`: parameters and fp32 states
in host memory, nothing recomputed, plain DeepSpeed) under the same budget, GPU_STEPS steps each. Keys:
`speedup_vs_deepspeed_default` (median step times, the plan's after its first check),
`pred_error_step_time` and `pred_error_peak_mem` (the first check), `achieved_tflops` (model FLOPs,
6 x tokens x the parameters multiplied plus causal attention, over the plan's median step) and
`model_flops_fraction` (over the GPU's dense bf16 peak, PEAK_BF16_TFLOPS; left out, with the reason, for
a GPU not in that table), `state_over_budget`. The results are written after the planned run and again
after the baseline, so that a run stopped in the baseline keeps the plan's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import emptied, write_results

from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
MODEL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 512}
SEQ_LEN, MICRO_BATCH = 256, 2
# The budget per rank, measured on the machine it runs on: 40% of the way from the least that admits
# a plan to what the all-in-memory plan needs (`plan.headroom_share`), so that it holds with any torch
# build or library version (a fixed byte count fitted one install only).
HEADROOM_SHARE = 0.4
# Depth of the model profiled partitioned (item 3 above): 0.84 GB of bf16 parameters.
PROFILE_LAYERS = 32
WARMUP_STEPS = 2
# Rounds of the three compared runs (item 2 above); each round starts the order one config later.
ROUNDS, QUICK_ROUNDS = 3, 2
COMPARED = ("planned", "deepspeed_default", "fixed_rule")
# A planned run compares after steps 2-4 and may plan again; its steps from here on are timed.
PLANNED_STEADY_FROM = 9
# The larger-than-memory run: the `1b` preset (1.1B parameters) on RANKS ranks, a few steps of short
# sequences (each step moves the optimizer state through NVMe). Its training state is counted as
# mixed-precision Adam's (bf16 parameters and gradients, fp32 master and two moments: 16 bytes per
# parameter), whatever formats the plan chose.
LARGER_STEPS, LARGER_SEQ_LEN, MIXED_PRECISION_ADAM_BYTES = 6, 64, 16
# The allocator settings lazyzero applies for a planned run (lazyzero/plan/deepspeed/host_memory.py), given
# to every run so that the baselines are measured with the same allocator.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "262144", "MALLOC_TRIM_THRESHOLD_": "1048576", "MALLOC_ARENA_MAX": "2"}
# The one-GPU run (--gpu): its config, steps per run, and the plan's steps from which it is timed (after
# its first check, steps 2-4, and any re-plan).
GPU_CONFIG = ROOT / "ds_configs" / "gpu_1b_planned_80gb.json"
GPU_MODEL, GPU_STEPS, GPU_PLANNED_STEADY_FROM = "1b", 10, 5
# Dense bf16 peak TFLOP/s by the name torch gives the device (NVIDIA's datasheets: H100 and H200 SXM).
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer training steps per run")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_planner", help="runs and configs go here")
    parser.add_argument("--nvme", default="/var/tmp", help="NVMe folder for every run")
    parser.add_argument("--profile-only", action="store_true",
                        help="only profile_peak_rss_over_model_bytes (about 4 minutes here), not the training runs")
    parser.add_argument("--larger-than-memory-only", action="store_true",
                        help="only the larger-than-memory run (the 1b preset, item 4 above)")
    parser.add_argument("--gpu", action="store_true",
                        help=f"only the {GPU_MODEL} preset on one GPU, planned and DeepSpeed's default (needs CUDA)")
    return parser.parse_args()


def base_config(nvme: str, work: Path) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01,
                                                 "torch_adam": True}},
        "zero_optimization": {"stage": 3},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 10**9,
    }


def planned_config(nvme: str, work: Path) -> dict:
    config = base_config(nvme, work)
    config["lazyzero"] = {"plan": {"enabled": True, "seq_len": SEQ_LEN, "headroom_share": HEADROOM_SHARE,
                                   "nvme_path": nvme, "profile_path": str(work / "profile.json"),
                                   "output_dir": str(work / "plan")}}
    return config


def train(name: str, config: dict, work: Path, steps: int, model: str | None = None,
          seq_len: int = SEQ_LEN, ranks: int = RANKS) -> list[dict]:
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "ds_config.json"
    config_path.write_text(json.dumps(config, indent=1))
    model = model or str(work / "model.json")
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(config_path), "--model", model,
            "--seq-len", str(seq_len), "--max-steps", str(steps), "--eval-problems", "0", "--output-dir", str(folder)]
    print(f"[bench_planner] {name}: {steps} steps", flush=True)
    started = time.perf_counter()
    proc = run_distributed("deepspeed", ranks, argv, timeout=3600, cwd=ROOT, env=ALLOCATOR_ENV)
    (folder / "output.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (see {folder / 'output.txt'}):\n{proc.stdout[-4000:]}")
    print(f"[bench_planner] {name}: done in {time.perf_counter() - started:.0f} s", flush=True)
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def baseline_configs(work: Path, nvme: Path) -> dict[str, dict]:
    """The fixed rule's and DeepSpeed default's configs for the planned run's own problem, each swapping
    into `nvme`/<its name>."""
    from lazyzero.config import PlanConfig
    from lazyzero.plan import deepspeed_default_plan, fixed_rule_plan
    from lazyzero.plan.deepspeed.implied import implied_setup
    from lazyzero.plan.deepspeed.problem_from_profile import problem_for_config
    from lazyzero.plan.profile.profiler import read_profile
    from lazyzero.plan.report import FIXED_RULE_K

    planned = planned_config(str(nvme / "planned"), work)
    settings = PlanConfig(**planned["lazyzero"]["plan"])
    problem, sizes = problem_for_config(read_profile(work / "profile.json"), planned, settings, RANKS, RANKS)
    configs = {}
    for name, plan in (("fixed_rule", fixed_rule_plan(problem, FIXED_RULE_K)),
                       ("deepspeed_default", deepspeed_default_plan(problem))):
        folder = str(nvme / name)
        configs[name] = implied_setup(problem, plan, base=base_config(folder, work), nvme_path=folder,
                                      sizes=sizes).ds_config
    return configs


def compare_in_rounds(work: Path, nvme: Path, steps: int, rounds: int) -> list[dict[str, list[dict]]]:
    """Each round's step records of the planned run and its two baselines (item 2 above). Round 1
    starts with the planned run, whose profile the baselines' configs are made from; each later round
    starts one config later. A run's NVMe folder is emptied and synced after it."""
    configs: dict[str, dict] = {}
    done = []
    for index in range(rounds):
        order = COMPARED[index % len(COMPARED):] + COMPARED[:index % len(COMPARED)]
        records = {}
        for name in order:
            if name == "planned":
                config = planned_config(str(nvme / name), work)
            else:
                configs = configs or baseline_configs(work, nvme)
                config = configs[name]
            (nvme / name).mkdir(parents=True, exist_ok=True)
            records[name] = train(f"round{index + 1}/{name}", config, work, steps)
            emptied(nvme / name)
        done.append(records)
    return done


def compared_step_s(rounds: list[dict[str, list[dict]]]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(each config's median step time over the timed steps of every round, each round's medians)."""
    def timed(name: str, records: list[dict]) -> list[float]:
        first = PLANNED_STEADY_FROM if name == "planned" else WARMUP_STEPS
        return [r["step_time_s"] for r in records[first:]]

    per_round = [{name: statistics.median(timed(name, records)) for name, records in done.items()} for done in rounds]
    pooled = {name: statistics.median([s for done in rounds for s in timed(name, done[name])]) for name in COMPARED}
    return pooled, per_round


def solve_80_layers() -> dict:
    """The 80-layer instance as written, and with DeepSpeed's all-or-none offload rule."""
    from lazyzero.plan import solve
    from lazyzero.plan.solver.instances import llama_like_80_layers

    results = {}
    for suffix, all_or_none in (("", False), ("_all_or_none", True)):
        started = time.perf_counter()
        plan = solve(llama_like_80_layers(all_or_none), time_limit_s=10, max_gap=0.01)
        results[f"solve_s_80_layers{suffix}"] = time.perf_counter() - started
        results[f"gap_80_layers{suffix}"] = plan.gap
    return results


def partitioned_profile(work: Path) -> tuple[dict, dict]:
    """(results, details) of profiling the model partitioned by zero.Init on RANKS ranks."""
    out, model = work / "partitioned_profile.json", work / "profiled_model.json"
    model.write_text(json.dumps({**MODEL, "vocab_size": 259, "num_hidden_layers": PROFILE_LAYERS}))
    argv = [str(ROOT / "benchmarks" / "planner_profile_worker.py"), str(model), str(out),
            str(SEQ_LEN), str(MICRO_BATCH)]
    proc = run_distributed("deepspeed", RANKS, argv, timeout=3600, cwd=ROOT, env=ALLOCATOR_ENV)
    if proc.returncode != 0:
        raise SystemExit(f"partitioned profile failed:\n{proc.stdout[-4000:]}")
    measured = json.loads(out.read_text())
    rise = max(rank["peak_bytes"] - rank["before_bytes"] for rank in measured["ranks"])
    return {"profile_peak_rss_over_model_bytes": rise / measured["model_bytes"]}, {"partitioned_profile": measured}


def larger_than_memory(work: Path, nvme: Path) -> tuple[dict, dict]:
    """(results, details) of the `1b` preset trained through the planner under a budget a fraction of its
    training state (ds_configs/cpu_1b_planned.json, its NVMe folder replaced by `nvme`/larger_than_memory)."""
    from lazyzero.plan.profile.profiler import read_profile

    config = json.loads((ROOT / "ds_configs" / "cpu_1b_planned.json").read_text())
    # A profile file of its own (measured afresh: the NVMe folder is new each run), so that the NVMe
    # speeds its step-time prediction rests on are reported beside it (docs/plan.md).
    profile_path = work / "larger_than_memory" / "profile.json"
    folder = nvme / "larger_than_memory"
    folder.mkdir(parents=True, exist_ok=True)
    config["lazyzero"]["plan"].update(nvme_path=str(folder), output_dir=str(work / "larger_than_memory" / "plan"),
                                      profile_path=str(profile_path))
    records = train("larger_than_memory", config, work, LARGER_STEPS, model="1b", seq_len=LARGER_SEQ_LEN)
    emptied(folder)
    report = json.loads((work / "larger_than_memory" / "report.json").read_text())
    profile = read_profile(profile_path)
    speeds = profile.machine.bandwidths
    budget, first = report["compute_budget_per_rank_bytes"], report["plan_checks"][0]
    state = report["parameters"] * MIXED_PRECISION_ADAM_BYTES
    results = {"larger_than_memory_state_over_budget": state / budget,
               "larger_than_memory_pred_error_step_time": abs(first["step_time_error"]),
               "larger_than_memory_pred_error_peak_mem": abs(first["peak_error"])}
    details = {"larger_than_memory": {
        "model": "1b", "parameters": report["parameters"], "seq_len": LARGER_SEQ_LEN, "steps": LARGER_STEPS,
        "budget_per_rank_bytes": budget, "training_state_bytes": state,
        "state_per_rank_over_budget": state / report["world_size"] / budget,
        "peak_rss_bytes": max(r["peak_mem_bytes"] for r in records), "plan_checks": report["plan_checks"],
        "plan_layers": report["plan"]["layers"], "step_s": [r["step_time_s"] for r in records],
        "setup_time_s": report.get("setup_time_s"), "wall_time_s": report.get("wall_time_s"),
        "profile_nvme_read_bytes_per_s": speeds["nvme_read"].bytes_per_s,
        "profile_nvme_write_bytes_per_s": speeds["nvme_write"].bytes_per_s,
        "priced_nvme_bytes_per_s": priced_speeds((work / "larger_than_memory" / "output.txt").read_text()),
        "calibration_engine_step_s": {engine_name(run): run.step_s for run in profile.engine.runs}}}
    return results, details


def engine_name(run) -> str:
    """A calibration engine's decoder layers and what it swapped ("3 nvme params": parameters alone)."""
    return f"{run.layers}{' nvme' if run.nvme else ''}{' params' if run.params_only else ''}"


def priced_speeds(printed: str) -> dict[str, float]:
    """The NVMe speeds the first plan was priced at (the plan table's "copy speeds priced" line: the one
    speed the NVMe calibration engine measured, lazyzero/plan/deepspeed/calibrate.py), bytes per second."""
    line = next(line for line in printed.splitlines() if "copy speeds priced:" in line)
    return {name: float(value) * 1e9 for name, value in re.findall(r"(nvme_\w+) ([0-9.]+) GB/s", line)}


def model_flops_per_step(preset_name: str, seq_len: int, micro_batch: int) -> float:
    """Training FLOPs of one step, recompute not counted: 3 x the forward's (deepspeed/costs.py: each
    multiplied weight 2 FLOPs a token, the lm_head's too; causal attention 2 x b x s^2 x h a layer)."""
    from lazyzero.models.presets import PRESETS
    from lazyzero.plan.deepspeed.costs import decoder_layer_tensors

    dims = PRESETS[preset_name]
    multiplied = dims.layers * sum(decoder_layer_tensors(dims).values()) + dims.vocab_size * dims.hidden
    forward = 2 * seq_len * micro_batch * multiplied + dims.layers * 2 * micro_batch * seq_len**2 * dims.hidden
    return 3 * forward


def peak_tflops(device: str) -> float | None:
    return next((value for name, value in PEAK_BF16_TFLOPS.items() if name in device), None)


def gpu_baseline_config(config: dict, profile_path: Path) -> dict:
    """DeepSpeed's default ZeRO-Infinity offload of the planned run's own problem (same profile, same
    budget), as the plain DeepSpeed config `implied` makes of it."""
    from lazyzero.config import PlanConfig
    from lazyzero.plan import deepspeed_default_plan
    from lazyzero.plan.deepspeed.implied import implied_setup
    from lazyzero.plan.deepspeed.problem_from_profile import problem_for_config
    from lazyzero.plan.profile.profiler import read_profile

    settings = PlanConfig(**config["lazyzero"]["plan"])
    problem, sizes = problem_for_config(read_profile(profile_path), config, settings, 1, 1)
    base = {key: value for key, value in config.items() if key != "lazyzero"}
    return implied_setup(problem, deepspeed_default_plan(problem), base=base, sizes=sizes).ds_config


def on_one_gpu(args: argparse.Namespace) -> None:
    """--gpu: the planned run, its figures written, then DeepSpeed's default and the speedup."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device here")
    work = args.work / "gpu"
    config = json.loads(GPU_CONFIG.read_text())
    plan_settings = config["lazyzero"]["plan"]
    profile_path = work / "planned" / "profile.json"
    plan_settings.update(output_dir=str(work / "planned" / "plan"), profile_path=str(profile_path))
    seq_len, micro_batch = plan_settings["seq_len"], config["train_micro_batch_size_per_gpu"]
    planned = train("gpu/planned", config, args.work, GPU_STEPS, model=GPU_MODEL, seq_len=seq_len, ranks=1)
    report = json.loads((work / "planned" / "report.json").read_text())
    first = report["plan_checks"][0]
    step_s = {"planned": statistics.median(r["step_time_s"] for r in planned[GPU_PLANNED_STEADY_FROM:])}
    flops = model_flops_per_step(GPU_MODEL, seq_len, micro_batch)
    device = torch.cuda.get_device_name()
    results = {"pred_error_step_time": abs(first["step_time_error"]), "pred_error_peak_mem": abs(first["peak_error"]),
               "achieved_tflops": flops / step_s["planned"] / 1e12,
               "state_over_budget": report["parameters"] * MIXED_PRECISION_ADAM_BYTES
               / report["compute_budget_per_rank_bytes"]}
    peak = peak_tflops(device)
    if peak is not None:
        results["model_flops_fraction"] = results["achieved_tflops"] / peak
    details = {"gpu": {"device": device, "peak_bf16_tflops": peak, "model": GPU_MODEL, "seq_len": seq_len,
                       "micro_batch": micro_batch, "model_flops_per_step": flops, "steps": GPU_STEPS,
                       "config": str(GPU_CONFIG.relative_to(ROOT)), "plan_checks": report["plan_checks"],
                       "plan_layers": report["plan"]["layers"], "setup_time_s": report.get("setup_time_s"),
                       "all_step_s": {"planned": [r["step_time_s"] for r in planned]}, "step_s": step_s,
                       "peak_mem_bytes": {"planned": max(r["peak_mem_bytes"] for r in planned)}}}
    if peak is None:
        details["gpu"]["skipped"] = {"model_flops_fraction": f"no dense bf16 peak known for {device!r}"}
    write_results(args.out, "bench_planner", args.quick, results, details)
    baseline = train("gpu/deepspeed_default", gpu_baseline_config(config, profile_path), args.work, GPU_STEPS,
                     model=GPU_MODEL, seq_len=seq_len, ranks=1)
    step_s["deepspeed_default"] = statistics.median(r["step_time_s"] for r in baseline[WARMUP_STEPS:])
    results["speedup_vs_deepspeed_default"] = step_s["deepspeed_default"] / step_s["planned"]
    details["gpu"]["all_step_s"]["deepspeed_default"] = [r["step_time_s"] for r in baseline]
    details["gpu"]["peak_mem_bytes"]["deepspeed_default"] = max(r["peak_mem_bytes"] for r in baseline)
    write_results(args.out, "bench_planner", args.quick, results, details)


def main() -> None:
    args = parse_args()
    if args.gpu:
        on_one_gpu(args)
        return
    # DeepSpeed never removes its swap files (zero_stage_3/ under the NVMe folder: 32 GB after the
    # 1b run), so every run swaps into a folder of its own under this one, removed at the end.
    scratch = Path(tempfile.mkdtemp(prefix="bench_planner_", dir=args.nvme))
    try:
        args.nvme = scratch
        run(args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace) -> None:
    steps = 14 if args.quick else 24
    args.work.mkdir(parents=True, exist_ok=True)
    if args.larger_than_memory_only:
        write_results(args.out, "bench_planner", args.quick, *larger_than_memory(args.work, args.nvme))
        return
    (args.work / "model.json").write_text(json.dumps({**MODEL, "vocab_size": 259}))
    profiled, profile_details = partitioned_profile(args.work)
    if args.profile_only:
        write_results(args.out, "bench_planner", args.quick, profiled, profile_details)
        return
    results = {**solve_80_layers(), **profiled}
    rounds = compare_in_rounds(args.work, args.nvme, steps, QUICK_ROUNDS if args.quick else ROUNDS)
    compared, details = compared_results(args.work, rounds)
    results.update(compared)
    # Last, so that its 32 GB of swap traffic precedes none of the compared runs.
    larger, larger_details = larger_than_memory(args.work, args.nvme)
    results.update(larger)
    details.update(steps=steps, **profile_details, **larger_details)
    write_results(args.out, "bench_planner", args.quick, results, details)


def compared_results(work: Path, rounds: list[dict[str, list[dict]]]) -> tuple[dict, dict]:
    """(results, details) of the compared runs: the first round's planned run gives the prediction
    errors, every round the speedups."""
    report = json.loads((work / "round1" / "planned" / "report.json").read_text())
    plan, checks = report["plan"], report["plan_checks"]
    step_s, per_round = compared_step_s(rounds)
    peak = {name: max(r["peak_mem_bytes"] for done in rounds for r in done[name]) for name in COMPARED}
    budget = report["compute_budget_per_rank_bytes"]
    first, last = checks[0], checks[-1]
    results = dict(
        pred_error_step_time=abs(first["step_time_error"]), pred_error_peak_mem=abs(first["peak_error"]),
        pred_error_step_time_replanned=abs(last["step_time_error"]),
        pred_error_peak_mem_replanned=abs(last["peak_error"]),
        speedup_vs_fixed_rule=step_s["fixed_rule"] / step_s["planned"],
        speedup_vs_deepspeed_default=step_s["deepspeed_default"] / step_s["planned"],
        peak_over_budget_planned=peak["planned"] / budget)
    details = {"step_s": step_s, "first_plan_error_by_round": first_plan_error_by_round(work, len(rounds)),
               "rounds": [
        {"order": list(done), "step_s": medians,
         "speedup_vs_fixed_rule": medians["fixed_rule"] / medians["planned"],
         "speedup_vs_deepspeed_default": medians["deepspeed_default"] / medians["planned"],
         "all_step_s": {name: [r["step_time_s"] for r in records] for name, records in done.items()}}
        for done, medians in zip(rounds, per_round)],
        "peak_rss_bytes": peak, "budget_per_rank_bytes": budget, "headroom_share": HEADROOM_SHARE,
        "plan_layers": plan["layers"], "plan_checks": checks,
        "peak_over_budget": {name: value / budget for name, value in peak.items()},
        "model": MODEL, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH, "ranks": RANKS}
    return results, details


def first_plan_error_by_round(work: Path, rounds: int) -> list[dict]:
    """Each round's planned run against its first plan's prediction: the first check (what the keys
    report for round 1) and the median of every check of that plan. A later round reads round 1's
    profile, so its first plan is the same one measured at another time: what separates the two is
    the machine's drift, not the prediction."""
    by_round = []
    for index in range(rounds):
        report = json.loads((work / f"round{index + 1}" / "planned" / "report.json").read_text())
        checks = [check for check in report["plan_checks"] if check["plan_index"] == 0]
        predicted = checks[0]["predicted_step_s"]
        by_round.append({"predicted_step_s": predicted, "first_check_error": checks[0]["step_time_error"],
                         "median_check_error": statistics.median(c["measured_step_s"] for c in checks) / predicted - 1,
                         "checks": len(checks)})
    return by_round


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
