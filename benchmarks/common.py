"""What every lazyzero benchmark shares: flags, thread pinning, timing, and the JSON it writes.

A benchmark script calls `parse_args`, `pin_threads`, times callables with `median_seconds`, and
ends with `write_results`, which adds the date and the machine description so numbers can be compared later.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lazyzero.plan.profile.machine import device_name


def parse_args(description: str) -> argparse.Namespace:
    """--quick (fewer repeats, for CI and smoke runs) and --out F.json (where results go)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="fewer repeats; same sizes")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    return parser.parse_args()


def pin_threads(threads: int) -> None:
    """Run torch's intra-op pool (OpenMP) on `threads` threads; OMP_NUM_THREADS is set too so that
    anything started later by this process sees the same count."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def median_seconds(cases: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each case over `repeats` runs, after one untimed warm-up run each.

    Runs are interleaved (case A, B, C, A, B, C, ...) so that a burst of load on a shared machine
    slows every case alike and ratios between cases stay meaningful; the median rather than the
    mean, so that one descheduled run does not move the result. CUDA work is synchronized before
    each clock reading.
    """
    timings: dict[str, list[float]] = {name: [] for name in cases}
    for name, fn in cases.items():
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            _synchronize()
            start = time.perf_counter()
            fn()
            _synchronize()
            timings[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in timings.items()}


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def gbps(bytes_moved: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes), counting bytes read plus bytes written."""
    return bytes_moved / seconds / 1e9


def machine_info() -> dict[str, object]:
    """What the numbers depend on: versions, threads, CPU (and GPU when there is one)."""
    info: dict[str, object] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_model": device_name(torch.device("cpu")),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_results(
    path: Path | None, benchmark: str, quick: bool, results: dict[str, float], details: dict | None = None
) -> dict[str, object]:
    """Print the results, and write them with `details` (nested, not printed; the README table
    reads only top-level numbers), the date and the machine description to `path` when given."""
    document = {"benchmark": benchmark, "quick": quick, "date": datetime.date.today().isoformat(), **results,
                **(details or {}), "machine": machine_info()}
    for key, value in results.items():
        print(f"{key:>20}  {value:10.3f}")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=2) + "\n")
        print(f"wrote {path}")
    return document


def emptied(folder: Path) -> None:
    """Remove what a run swapped into `folder` (DeepSpeed leaves its swap files) and flush what else the
    run wrote (its logs, reports, profile; the swap files themselves are written with O_DIRECT), so
    that the next run starts on a quiet disk."""
    for entry in folder.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    os.sync()
