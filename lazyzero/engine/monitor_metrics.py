"""lazyzero's step metrics into DeepSpeed's monitor (TensorBoard, W&B, CSV, Comet), as `lazyzero/<key>`.

Users of the Hugging Face Trainer or Accelerate read the files DeepSpeed's `MonitorMaster` writes
from the config's `tensorboard`, `wandb`, `csv_monitor` and `comet` sections, not lazyzero's
metrics.jsonl; so each optimizer step's metrics go through the engine's own monitor
(docs/deepspeed-internals.md, "The monitor"). Most metrics are one rank's figures, and the monitor
writes on rank 0 only, so every rank's values are gathered there first: seconds, peaks and overflow
flags are the largest over the ranks (a step waits for its slowest rank), everything else the mean
over the ranks (a per-rank figure stays per rank). Numbers only: text metrics (a checkpoint's tag)
stay in metrics.jsonl.
"""

from __future__ import annotations

import math
import numbers

PREFIX = "lazyzero/"


def reduction_of(key: str) -> str:
    """"max" or "mean": how the ranks' values of metric `key` become the one value written."""
    if key.endswith("_s") or "peak" in key or "overflow" in key:
        return "max"
    return "mean"


def numeric_metrics(metrics: dict) -> dict[str, float]:
    """The metrics a monitor can plot: finite numbers (booleans as 0/1)."""
    return {key: float(value) for key, value in metrics.items()
            if isinstance(value, numbers.Real) and math.isfinite(float(value))}


def reduce_over_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One value per key from every rank's metrics; a key some ranks lack is reduced over those that have it."""
    keys = dict.fromkeys(key for metrics in per_rank for key in metrics)
    reduced = {}
    for key in keys:
        values = [metrics[key] for metrics in per_rank if key in metrics]
        reduced[key] = max(values) if reduction_of(key) == "max" else sum(values) / len(values)
    return reduced


def monitor_events(metrics: dict[str, float], step: int) -> list[tuple[str, float, int]]:
    """DeepSpeed's event tuples: (name, value, step)."""
    return [(PREFIX + key, value, step) for key, value in metrics.items()]


def reduced_over_ranks(metrics: dict) -> dict[str, float]:
    """This rank's numeric `metrics` and every other rank's, one value per key (a collective: every
    rank calls it)."""
    import torch.distributed

    mine = numeric_metrics(metrics)
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return mine
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    return reduce_over_ranks(gathered)


def write_step_metrics(engine, metrics: dict) -> None:
    """Write one optimizer step's metrics through `engine.monitor` (a collective: every rank calls it)."""
    reduced = reduced_over_ranks(metrics)
    if engine.global_rank == 0:
        engine.monitor.write_events(monitor_events(reduced, engine.global_steps))
