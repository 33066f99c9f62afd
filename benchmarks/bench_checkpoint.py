"""Training stall per checkpoint: DeepSpeed's default engine, its decoupled writer, and lazyzero (docs/checkpoint.md).

    python benchmarks/bench_checkpoint.py --quick --out /tmp/bench_checkpoint.json

A llama-shaped model of about 200M parameters (`MODEL_200M`; --model picks another, e.g. `demo`
while developing), fp32, ZeRO-3, AdamW (ds_configs/cpu_demo.json), 2 CPU ranks of 1 thread each,
synthetic token batches from a fixed seed. One launch of checkpoint_worker.py per engine, in turn:
`deepspeed` (no "checkpoint.writer": torch.save inside save_checkpoint), `decoupled` (writer
"python", decoupled: a writer process, waited for in the next step) and `lazyzero` (lazy mode,
keep_last 2). Each launch runs warm-up steps, then cycles of
    save_checkpoint + BLOCK steps  |  BLOCK steps without a save        (BLOCK = 5)
so that the blocks without a save, measured between the others, are the reference. Before each
block, outside timing, every dirty page is flushed (os.sync): DeepSpeed's engines do not fsync,
and the kernel's writeback of their checkpoint would otherwise slow the reference block after
them. Writeback after a block with a save is thus not charged to DeepSpeed (in its favour).

What is reported (rank 0's clocks; steps are collective, so both ranks' clocks agree):
- stall_s[engine]: per checkpoint, seconds inside save_checkpoint plus, over the BLOCK steps that
  follow it, each step's time minus the median step time of the blocks without a save just before
  and just after them (a slow drift of the step time cancels out); the median over checkpoints.
  The first checkpoint is left out of the median and reported on its own (lazyzero allocates its
  staging blocks and host buffers then, and first touches their pages).
- stall_ratio_vs_deepspeed: stall_s["deepspeed"] over lazyzero's stall, where lazyzero's stall is
  floored at the noise of the measurement (`noise_s`: the same sum of step-time deviations over a
  block *without* a save against its neighbours, in absolute value, median over cycles), so that
  noise cannot produce a huge or negative ratio; the ratio is then a lower bound. Unfloored
  figures are in `engines`.
- e2e_overhead: lazyzero's seconds of the blocks with a save (save included) over those of the
  blocks without, summed over the measured cycles: training time with a checkpoint every BLOCK
  steps over training time without. It holds only if each checkpoint was committed within its
  block (`lazyzero_checks.committed_within_interval`; a warning is printed otherwise), as it is the
  case when a checkpoint every BLOCK steps never waits for the previous one.
- write_bw_ratio: lazyzero's write bandwidth over a plain sequential write's, summed over ranks,
  both with training paused (the same conditions). lazyzero's, per rank: `last_commit` bytes /
  write_s of one more checkpoint saved and waited for; write_s runs from the save to this rank's
  files and folders durable: the snapshot (host tensors are written straight from training's
  memory, others copied into host buffers first), serializing with torch.save, hashing, writing
  and fsyncing (not the agreement or rank 0's commit). The plain one, per rank: the same number of
  bytes written to a new file in the same folder in 64 MiB os.write calls from a ready buffer,
  fsync of file and folder, both ranks at once; median over repeats. While training runs, the
  writer only gets the CPU time training leaves idle (SCHED_IDLE), by design: its bandwidth then
  is in `write_bandwidth.write_bw_ratio_while_training`.
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
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import pin_threads, write_results  # noqa: E402

from lazyzero.distributed.shm_segments import remove_leftover_segments  # noqa: E402
from lazyzero.models.config import preset_config  # noqa: E402
from lazyzero.models.presets import SUBWORD_VOCAB_SIZE, ModelPreset  # noqa: E402
from lazyzero.testing import distributed_env, free_port, launch_command  # noqa: E402

WORKER = Path(__file__).resolve().parent / "checkpoint_worker.py"
ENGINES = ("deepspeed", "decoupled", "lazyzero")
WORLD_SIZE = 2
THREADS_PER_RANK = 1  # 2 ranks share the 2 cores of the reference machine
BLOCK = 5  # a checkpoint every 5 steps (the issue)
# llama family, hidden 1024, 10 layers, MLP 3072, 32000-token vocabulary: 201.9M parameters, the
# size of the baseline in docs/deepspeed-internals.md ("Checkpoints").
MODEL_200M = ModelPreset(1024, 10, 16, 16, 3072, SUBWORD_VOCAB_SIZE, 2048)
MICRO_BATCH, SEQUENCE = 1, 64  # a step of a few seconds on 2 cores
LAUNCH_TIMEOUT_S = 3600


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer checkpoints; same sizes")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--model", default="200m", help="'200m' (default), or a lazyzero preset name such as 'demo'")
    parser.add_argument("--save-dir", type=Path, help="where checkpoints go (default: a new folder under the temp dir)")
    return parser.parse_args()


def model_spec(name: str, folder: Path) -> str:
    """What the worker passes to build_model: a preset name, or a config.json written for '200m'."""
    if name != "200m":
        return name
    path = folder / "model_200m_config.json"
    preset_config(MODEL_200M, "llama", None, None).to_json_file(str(path))
    return str(path)


def run_engine(engine: str, spec: str, save_root: Path, quick: bool) -> dict:
    """One 2-rank launch of the worker for `engine`; its JSON (every rank's record). Lines the worker
    prints for progress are echoed; the whole output is kept in a log beside the checkpoints and
    shown (its end) if the launch fails."""
    save_dir, out, log = save_root / engine, save_root / f"{engine}.json", save_root / f"{engine}.log"
    argv = [str(WORKER), "--engine", engine, "--model", spec, "--save-dir", str(save_dir), "--out", str(out),
            "--cycles", str(4 if quick else 9), "--interval", str(BLOCK), "--warmup-steps", "2",
            "--batch", str(MICRO_BATCH), "--seq", str(SEQUENCE), "--plain-write-repeats", str(3 if quick else 5)]
    port = free_port()
    try:
        with log.open("w") as sink:
            code = stream_launch(launch_command("deepspeed", WORLD_SIZE, argv, port=port), sink)
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


def median_step_s(cycles: list[dict], indices: Iterable[int]) -> float:
    """Median step time of the blocks without a save of the cycles at `indices` (those that exist)."""
    chosen = [cycles[i] for i in indices if 0 <= i < len(cycles)]
    return statistics.median(s for c in chosen for s in c["steps_without_save_s"])


def stall_figures(record: dict) -> dict:
    """Stall per checkpoint and end-to-end overhead from one rank's cycles (see the module docstring)."""
    cycles = record["cycles"]
    measured = cycles[1:]
    # The reference of a block with a save: the blocks without one just before and just after it,
    # so that a slow drift of the step time during a launch cancels out.
    added = [sum(s - median_step_s(cycles, (i - 1, i)) for s in c["steps_after_save_s"]) for i, c in enumerate(cycles)]
    stalls = [c["save_s"] + extra for c, extra in zip(cycles, added)]
    # The same sum over a block without a save, against its own neighbours: what the estimate
    # shows when nothing is added.
    noise = [abs(sum(s - median_step_s(cycles, (i - 1, i + 1)) for s in c["steps_without_save_s"]))
             for i, c in enumerate(cycles) if i > 0]

    def seconds_with_save(chosen: list[dict]) -> float:
        return sum(c["save_s"] + sum(c["steps_after_save_s"]) for c in chosen)

    def seconds_without_save(chosen: list[dict]) -> float:
        return sum(sum(c["steps_without_save_s"]) for c in chosen)

    return {
        "stall_s": statistics.median(stalls[1:]),
        "noise_s": statistics.median(noise),
        "first_checkpoint_stall_s": stalls[0],
        "save_call_s": statistics.median(c["save_s"] for c in measured),
        "added_to_steps_s": statistics.median(added[1:]),
        "step_s_without_save": median_step_s(cycles, range(1, len(cycles))),
        "step_s_after_save": statistics.median(s for c in measured for s in c["steps_after_save_s"]),
        "e2e_overhead": seconds_with_save(measured) / seconds_without_save(measured),
        "e2e_overhead_including_first": seconds_with_save(cycles) / seconds_without_save(cycles),
        "checkpoints_measured": len(measured),
        "per_checkpoint_stall_s": stalls,
        "bytes_on_disk": max((c["bytes_on_disk"] for c in cycles if c["bytes_on_disk"]), default=None),
    }


def write_bandwidth(records: list[dict]) -> dict:
    """lazyzero's write bandwidth against the plain sequential write, per rank and summed."""
    per_rank = []
    for record in records:
        commits = list(record["lazyzero"]["commits"].values())
        plain = record["plain_write"]
        per_rank.append({
            "rank": record["rank"], "bytes": statistics.median(c["bytes"] for c in commits),
            "write_s": statistics.median(c["write_s"] for c in commits),
            "lazyzero_gbps": statistics.median(c["bytes"] / c["write_s"] for c in commits) / 1e9,
            "plain_gbps": plain["bytes"] / statistics.median(plain["seconds"]) / 1e9,
            "lazyzero_paused_gbps": record["paused_write"]["bytes"] / record["paused_write"]["write_s"] / 1e9,
            "copy_s": statistics.median(c["copy_s"] for c in commits),
            "direct_bytes": statistics.median(c["direct_bytes"] for c in commits),
            "step_wait_s": statistics.median(c["step_wait_s"] for c in commits),
            "queued_to_committed_s": statistics.median(c["queued_to_committed_s"] for c in commits),
            "commits_seen": len(commits)})
    plain = sum(r["plain_gbps"] for r in per_rank)
    return {"write_bw_ratio": sum(r["lazyzero_paused_gbps"] for r in per_rank) / plain,
            "write_bw_ratio_while_training": sum(r["lazyzero_gbps"] for r in per_rank) / plain,
            "per_rank": per_rank}


def lazyzero_checks(records: list[dict]) -> dict:
    """That every lazyzero checkpoint was committed, and how many within their BLOCK steps."""
    rank0 = records[0]
    saved, newest = len(rank0["cycles"]), rank0["lazyzero"]["newest_committed"]
    return {"checkpoints_saved": saved,
            # wait_for_checkpoints raises if any queued checkpoint failed: reaching it means all committed.
            "checkpoints_committed": saved if newest == rank0["cycles"][-1]["tag"] else None,
            "committed_within_interval": sum(bool(c["committed_within_interval"]) for c in rank0["cycles"]),
            "newest_verified": rank0["lazyzero"]["newest_verified"],
            "tags_on_disk": rank0["lazyzero"]["tags_on_disk"],
            "final_wait_s": rank0["lazyzero"]["final_wait_s"]}


def summarize(runs: dict[str, dict]) -> tuple[dict[str, float], dict]:
    """(headline results, details) from every engine's records."""
    figures = {engine: stall_figures(run["ranks"][0]) for engine, run in runs.items()}
    ours = figures["lazyzero"]
    floored = max(ours["stall_s"], ours["noise_s"])
    bandwidth = write_bandwidth(runs["lazyzero"]["ranks"])
    results = {"stall_ratio_vs_deepspeed": figures["deepspeed"]["stall_s"] / floored,
               "e2e_overhead": ours["e2e_overhead"], "write_bw_ratio": bandwidth["write_bw_ratio"]}
    # Nested below the map `stall_s`, so that readme_table.py shows only the headline figures as rows.
    details = {
        "stall_s": {engine: f["stall_s"] for engine, f in figures.items()},
        "context": {"stall_ratio_vs_decoupled": figures["decoupled"]["stall_s"] / floored,
                    "parameters": runs["lazyzero"]["ranks"][0]["parameters"],
                    "bytes_per_checkpoint_per_rank": bandwidth["per_rank"][0]["bytes"],
                    "lowest_mem_available_gb": {engine: min(r["lowest_mem_available_gb"] for r in run["ranks"])
                                                for engine, run in runs.items()}},
        "engines": figures, "write_bandwidth": bandwidth, "lazyzero_checks": lazyzero_checks(runs["lazyzero"]["ranks"]),
    }
    return results, details


def print_table(details: dict) -> None:
    print(f"\n{details['context']['parameters'] / 1e6:.1f}M parameters, ZeRO-3 fp32, {WORLD_SIZE} ranks, "
          f"a checkpoint every {BLOCK} steps (seconds; e2e: time with checkpoints over time without)")
    columns = {"stall_s": "stall", "save_call_s": "in save", "added_to_steps_s": "added to steps",
               "noise_s": "noise", "first_checkpoint_stall_s": "first stall", "step_s_without_save": "step",
               "e2e_overhead": "e2e"}
    print(f"{'engine':>10} " + " ".join(f"{header:>14}" for header in columns.values()))
    for engine, figures in details["engines"].items():
        print(f"{engine:>10} " + " ".join(f"{figures[name]:14.3f}" for name in columns))
    for rank in details["write_bandwidth"]["per_rank"]:
        print(f"rank {rank['rank']}: lazyzero writes {rank['bytes'] / 1e9:.2f} GB in {rank['write_s']:.2f} s "
              f"({rank['lazyzero_gbps']:.2f} GB/s; {rank['lazyzero_paused_gbps']:.2f} GB/s with training paused), "
              f"plain write {rank['plain_gbps']:.2f} GB/s")
    print()


def main() -> None:
    args = parse_args()
    pin_threads(THREADS_PER_RANK)  # what the ranks run with, and what write_results records
    started = time.perf_counter()
    save_root = Path(tempfile.mkdtemp(prefix="bench_checkpoint-", dir=args.save_dir))
    spec = model_spec(args.model, save_root)
    runs = {engine: run_engine(engine, spec, save_root, args.quick) for engine in ENGINES}
    # Only now: after a failure the launch logs stay there (checkpoints are removed after each launch).
    shutil.rmtree(save_root)
    results, details = summarize(runs)
    details["setup"] = {"model": args.model, "micro_batch": MICRO_BATCH, "sequence": SEQUENCE, "world_size": WORLD_SIZE,
                        "threads_per_rank": THREADS_PER_RANK, "block_steps": BLOCK,
                        "runtime_s": time.perf_counter() - started}
    details["raw"] = {engine: run["ranks"] for engine, run in runs.items()}
    print_table(details)
    checks = details["lazyzero_checks"]
    if checks["committed_within_interval"] < checks["checkpoints_saved"]:
        print(f"warning: only {checks['committed_within_interval']} of {checks['checkpoints_saved']} lazyzero "
              f"checkpoints were committed within their {BLOCK} steps: the rest of their writing ran in the blocks "
              "without a save (or between blocks), so stall and e2e_overhead understate lazyzero's cost")
    write_results(args.out, "bench_checkpoint", args.quick, results, details)


if __name__ == "__main__":
    main()
