"""Training stall per checkpoint: DeepSpeed's default engine, its decoupled writer, PyTorch's
torch.distributed.checkpoint.async_save and lazyzero, with 95% confidence intervals, on busy and on
idle host cores (docs/checkpoint.md).

    python benchmarks/bench_checkpoint.py --quick --out /tmp/bench_checkpoint.json
    python benchmarks/bench_checkpoint.py --out /tmp/bench_checkpoint_full.json

A llama-shaped model (`--quick`: about 100M parameters, `MODEL_100M`; full: about 200M, `MODEL_200M`; --model
picks a preset such as `demo` while developing), fp32, ZeRO-3, AdamW (ds_configs/cpu_demo.json), 2 CPU ranks
of 1 thread each, synthetic token batches from a fixed seed. One launch of checkpoint_worker.py per engine, in
turn: `deepspeed` (torch.save inside save_checkpoint), `decoupled` (writer "python", decoupled: a writer
process, waited for in the next step), `lazyzero` (lazy mode, keep_last 2) and `dcp_async` (DeepSpeed's
engine, its optimizer state saved by torch.distributed.checkpoint.async_save, waited for at the block's end as
lazyzero's commit is). Each launch measures both scenarios (see the worker): `busy_cores` (every step computes
on the host) and `idle_cores` (the accelerator's forward and backward are a sleep of their measured time, as
the host of a GPU run sees them).

What is reported (rank 0's clocks; steps are collective, so both ranks' clocks agree):
- stall per checkpoint: over pairs of adjacent blocks of BLOCK steps in ABBA order, the mean of
  (block with a checkpoint, save and any final wait included) - (block without), with its Student t
  interval (benchmarks/interval_stats.py).
- stall_ratio_vs_deepspeed[_idle_cores]: DeepSpeed's stall over lazyzero's (and, in `intervals`,
  the same against `decoupled` and `dcp_async`), with the interval the
  two intervals imply. When lazyzero's interval includes zero the ratio is not resolved: the
  figure is then a lower bound (DeepSpeed's low end over lazyzero's high end), marked as such.
- e2e_overhead[_idle_cores]: lazyzero's mean over pairs of (block with) / (block without):
  training time with a checkpoint every BLOCK steps over training time without.
- write_bw_ratio: lazyzero's write bandwidth with training paused over a plain sequential write's
  (64 MiB os.write calls from a ready buffer, fsync), summed over ranks; write_bw_ratio_idle_cores:
  the same with lazyzero's bandwidth while training on idle cores (on busy cores its writer only
  gets what training leaves, by design: SCHED_IDLE; that figure is in `write_bandwidth`).
- commit_steps_idle_cores: steps from lazyzero's save to its commit (median), in steps without a
  checkpoint; a checkpoint every BLOCK steps must commit within BLOCK.
- Counted directly, per checkpoint (they do not drift with the machine): CPU seconds of lazyzero's
  copy, flush and writer threads; seconds training waited for them (optimizer steps waiting for the
  snapshot, a save waiting for a free buffer, the final wait); CPU seconds of DeepSpeed's save call.
`--gpu` (benchmarks/gpu_checks.sh): one rank on the GPU (NCCL), DeepSpeed's default engine and
lazyzero's only; the same keys (`stall_ratio_vs_deepspeed` is then the one GPU's; `idle_cores` runs
the GPU's real forward and backward of a short batch plus a sleep, a figure with little meaning there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import pin_threads, write_results  # noqa: E402
from interval_stats import Interval, describe, mean_interval, ratio_interval  # noqa: E402

from lazyzero.distributed.shm_segments import remove_leftover_segments  # noqa: E402
from lazyzero.models.config import preset_config  # noqa: E402
from lazyzero.models.presets import SUBWORD_VOCAB_SIZE, ModelPreset  # noqa: E402
from lazyzero.testing import distributed_env, free_port, launch_command  # noqa: E402

WORKER = Path(__file__).resolve().parent / "checkpoint_worker.py"
ENGINES = ("deepspeed", "decoupled", "lazyzero", "dcp_async")
BASELINES = ("deepspeed", "decoupled", "dcp_async")
SCENARIOS = ("busy_cores", "idle_cores")
WORLD_SIZE = 2
THREADS_PER_RANK = 1  # 2 ranks share the 2 cores of the reference machine
BLOCK = 3  # steps per block: a checkpoint every 3 steps; lazyzero commits within about 2 steps here
# llama family, 32000-token vocabulary. 200M: hidden 1024, 10 layers, MLP 3072 (201.9M parameters,
# the baseline of docs/deepspeed-internals.md, "Checkpoints"); 100M: hidden 768, 8 layers, MLP 2048.
MODEL_200M = ModelPreset(1024, 10, 16, 16, 3072, SUBWORD_VOCAB_SIZE, 2048)
MODEL_100M = ModelPreset(768, 8, 12, 12, 2048, SUBWORD_VOCAB_SIZE, 2048)
MICRO_BATCH, SEQUENCE = 1, 64
PAIRS = {True: 5, False: 10}  # per scenario: quick, full
LAUNCH_TIMEOUT_S = 3600


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 100M model and fewer pairs")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--model", help="a lazyzero preset name such as 'demo' instead of the llama above")
    parser.add_argument("--pairs", type=int, help="pairs of blocks per scenario (default: 5 quick, 10 full)")
    parser.add_argument("--save-dir", type=Path, help="where checkpoints go (default: a new folder under the temp dir)")
    parser.add_argument("--engines", type=lambda text: tuple(text.split(",")), default=ENGINES,
                        help=f"engines to launch, comma-separated, lazyzero among them (default: {','.join(ENGINES)})")
    parser.add_argument("--copy-bandwidth-share", type=float,
                        help="lazyzero.checkpoint.copy_bandwidth_share for lazyzero's launch (default: the config's)")
    parser.add_argument("--gpu", action="store_true", help="one rank on the GPU, DeepSpeed's engine and lazyzero's")
    return parser.parse_args()


def model_spec(args: argparse.Namespace, folder: Path) -> str:
    """What the worker passes to build_model: a preset name, or a config.json written for the llama."""
    if args.model:
        return args.model
    path = folder / "model_config.json"
    preset_config(MODEL_100M if args.quick else MODEL_200M, "llama", None, None).to_json_file(str(path))
    return str(path)


def run_engine(engine: str, spec: str, save_root: Path, pairs: int, accelerator_s: float | None,
               world_size: int = WORLD_SIZE, copy_bandwidth_share: float | None = None) -> dict:
    """One 2-rank launch of the worker for `engine`; its JSON (every rank's record). Lines the worker
    prints for progress are echoed; the whole output is kept in a log beside the checkpoints and
    shown (its end) if the launch fails."""
    save_dir, out, log = save_root / engine, save_root / f"{engine}.json", save_root / f"{engine}.log"
    argv = [str(WORKER), "--engine", engine, "--model", spec, "--save-dir", str(save_dir), "--out", str(out),
            "--pairs", str(pairs), "--interval", str(BLOCK), "--batch", str(MICRO_BATCH), "--seq", str(SEQUENCE)]
    if accelerator_s is not None:
        argv += ["--accelerator-s", repr(accelerator_s)]
    if copy_bandwidth_share is not None:
        argv += ["--copy-bandwidth-share", repr(copy_bandwidth_share)]
    port = free_port()
    try:
        with log.open("w") as sink:
            code = stream_launch(launch_command("deepspeed", world_size, argv, port=port), sink)
    finally:
        remove_leftover_segments(port)
        shutil.rmtree(save_dir, ignore_errors=True)
    if code != 0 or not out.is_file():
        raise SystemExit(f"{engine}: the launch failed (exit {code}); end of {log}:\n{log.read_text()[-6000:]}")
    return json.loads(out.read_text())


def stream_launch(command: list[str], sink) -> int:
    """Run a launch in its own process group, copy its output to `sink`, echo the worker's progress
    lines; its exit code. On a timeout or an interrupt the whole group is stopped: the deepspeed
    runner does not pass a SIGTERM on to the ranks."""
    proc = subprocess.Popen(command, env=distributed_env(THREADS_PER_RANK), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    watchdog = threading.Timer(LAUNCH_TIMEOUT_S, os.killpg, (proc.pid, signal.SIGTERM))
    watchdog.start()
    try:
        for line in proc.stdout:
            sink.write(line)
            if "[checkpoint_worker]" in line:
                print(line, end="", flush=True)
        return proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    finally:
        watchdog.cancel()


def scenario_figures(pairs: list[dict]) -> dict:
    """One engine in one scenario: stall and e2e intervals, and what is counted per checkpoint."""
    with_blocks = [p["with"] for p in pairs]
    stall = mean_interval([p["with"]["block_s"] - p["without"]["block_s"] for p in pairs])
    e2e = mean_interval([p["with"]["block_s"] / p["without"]["block_s"] for p in pairs])
    figures = {"stall": stall.as_dict(), "e2e_overhead": e2e.as_dict(),
               "save_call_s": statistics.median(b["save_s"] for b in with_blocks),
               "save_call_main_cpu_s": statistics.median(b["save_main_cpu_s"] for b in with_blocks),
               "final_wait_s": statistics.median(b["final_wait_s"] for b in with_blocks),
               "block_without_s": statistics.median(p["without"]["block_s"] for p in pairs),
               "pairs": len(pairs)}
    commits = [b["commit"] for b in with_blocks if "commit" in b]
    if commits:
        figures["per_checkpoint"] = {key: statistics.median(c[key] for c in commits) for key in
                                     ("background_cpu_s", "step_wait_s", "slot_wait_s", "copy_s", "write_s",
                                      "queued_to_committed_s", "bytes")}
        figures["per_checkpoint"]["training_waited_s"] = statistics.median(
            c["step_wait_s"] + c["slot_wait_s"] + b["final_wait_s"] for c, b in zip(commits, with_blocks))
    return figures


def commit_steps(figures: dict) -> float:
    """Steps from a save to its commit (median), in the scenario's own step time without a checkpoint."""
    return figures["per_checkpoint"]["queued_to_committed_s"] / (figures["block_without_s"] / BLOCK)


def write_bandwidth(records: list[dict]) -> dict:
    """lazyzero's write bandwidth (paused, and while training in each scenario) against the plain
    sequential write, summed over ranks."""
    per_rank = []
    for record in records:
        plain = record["plain_write"]
        rank = {"rank": record["rank"], "plain_gbps": plain["bytes"] / statistics.median(plain["seconds"]) / 1e9,
                "paused_gbps": record["paused_write"]["bytes"] / record["paused_write"]["write_s"] / 1e9}
        for scenario in SCENARIOS:
            commits = [p["with"]["commit"] for p in record["scenarios"][scenario]]
            rank[f"{scenario}_gbps"] = statistics.median(c["bytes"] / c["write_s"] for c in commits) / 1e9
        per_rank.append(rank)
    plain = sum(r["plain_gbps"] for r in per_rank)
    ratios = {"write_bw_ratio": sum(r["paused_gbps"] for r in per_rank) / plain}
    ratios.update({f"write_bw_ratio_{scenario}": sum(r[f"{scenario}_gbps"] for r in per_rank) / plain
                   for scenario in SCENARIOS})
    return {**ratios, "per_rank": per_rank}


def lazyzero_checks(record: dict) -> dict:
    """That every lazyzero checkpoint was committed (the worker raises otherwise) and the newest verifies."""
    return {"checkpoints_committed": sum(len(pairs) for pairs in record["scenarios"].values()) + 1,
            **record["lazyzero"]}


def summarize(runs: dict[str, dict]) -> tuple[dict[str, float], dict]:
    """(headline results, details) from every engine's records."""
    figures = {engine: {scenario: scenario_figures(run["ranks"][0]["scenarios"][scenario]) for scenario in SCENARIOS}
               for engine, run in runs.items()}
    bandwidth = write_bandwidth(runs["lazyzero"]["ranks"])
    intervals = {}
    for scenario in SCENARIOS:
        suffix = "" if scenario == "busy_cores" else "_idle_cores"
        ours = Interval(**figures["lazyzero"][scenario]["stall"])
        for baseline in (name for name in BASELINES if name in runs):
            intervals[f"stall_ratio_vs_{baseline}{suffix}"] = ratio_interval(
                Interval(**figures[baseline][scenario]["stall"]), ours)
        intervals[f"e2e_overhead{suffix}"] = Interval(**figures["lazyzero"][scenario]["e2e_overhead"])
    headline = ("stall_ratio_vs_deepspeed", "stall_ratio_vs_deepspeed_idle_cores", "e2e_overhead",
                "e2e_overhead_idle_cores")
    results = {key: intervals[key].value for key in headline if key in intervals}
    results["commit_steps_idle_cores"] = commit_steps(figures["lazyzero"]["idle_cores"])
    results.update({key: bandwidth[key] for key in ("write_bw_ratio", "write_bw_ratio_idle_cores")})
    rank0 = runs["lazyzero"]["ranks"][0]
    details = {
        "intervals": {key: interval.as_dict() for key, interval in intervals.items()},
        "context": {"parameters": rank0["parameters"],
                    "bytes_per_checkpoint_per_rank": rank0["paused_write"]["bytes"],
                    "accelerator_s_per_step": {engine: run["ranks"][0]["warmup"]["accelerator_s"]
                                               for engine, run in runs.items()},
                    "lowest_mem_available_gb": {engine: min(r["lowest_mem_available_gb"] for r in run["ranks"])
                                                for engine, run in runs.items()},
                    "baseline_checkpoint_bytes_on_disk": {engine: run["ranks"][0]["last_checkpoint_bytes_on_disk"]
                                                          for engine, run in runs.items() if engine in BASELINES}},
        "engines": figures, "write_bandwidth": bandwidth, "lazyzero_checks": lazyzero_checks(rank0),
    }
    return results, details


def print_table(details: dict) -> None:
    print(f"\n{details['context']['parameters'] / 1e6:.1f}M parameters, ZeRO-3 fp32, {details['setup']['world_size']} "
          "ranks, "
          f"a checkpoint every {BLOCK} steps; stall per checkpoint in seconds (95% CI)")
    for scenario in SCENARIOS:
        print(f"  {scenario}:")
        for engine, by_scenario in details["engines"].items():
            figures = by_scenario[scenario]
            counted = figures.get("per_checkpoint")
            extra = (f"; background CPU {counted['background_cpu_s']:.2f} s, training waited "
                     f"{counted['training_waited_s']:.3f} s" if counted else
                     f"; save call {figures['save_call_s']:.3f} s ({figures['save_call_main_cpu_s']:.2f} s CPU)")
            print(f"    {engine:>10}: stall {describe(Interval(**figures['stall']))}, "
                  f"block without {figures['block_without_s']:.2f} s{extra}")
    for key, interval in details["intervals"].items():
        print(f"  {key}: {describe(Interval(**interval))}")
    print()


def main() -> None:
    args = parse_args()
    pin_threads(THREADS_PER_RANK)  # what the ranks run with, and what write_results records
    started = time.perf_counter()
    save_root = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=args.save_dir))
    spec = model_spec(args, save_root)
    pairs = args.pairs or PAIRS[args.quick]
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device here")
    engines, world_size = (("deepspeed", "lazyzero"), 1) if args.gpu else (args.engines, WORLD_SIZE)
    if "lazyzero" not in engines or not set(engines) <= set(ENGINES):
        raise SystemExit(f"--engines {','.join(engines)}: lazyzero and any of {', '.join(ENGINES)}")
    runs, accelerator_s = {}, None
    for engine in engines:
        runs[engine] = run_engine(engine, spec, save_root, pairs, accelerator_s, world_size,
                                  args.copy_bandwidth_share)
        # The idle_cores sleep is measured once, in the first launch, and given to the others.
        accelerator_s = runs[engine]["ranks"][0]["warmup"]["accelerator_s"]
    # Only now: after a failure the launch logs stay there (checkpoints are removed after each launch).
    shutil.rmtree(save_root)
    results, details = summarize(runs)
    details["setup"] = {"model": args.model or ("100m" if args.quick else "200m"), "micro_batch": MICRO_BATCH,
                        "sequence": SEQUENCE, "world_size": world_size, "gpu": args.gpu,
                        "threads_per_rank": THREADS_PER_RANK,
                        "block_steps": BLOCK, "pairs_per_scenario": pairs, "runtime_s": time.perf_counter() - started,
                        "copy_bandwidth_share": args.copy_bandwidth_share}
    details["raw"] = {engine: run["ranks"] for engine, run in runs.items()}
    print_table(details)
    write_results(args.out, "bench_checkpoint", args.quick, results, details)


if __name__ == "__main__":
    main()
