"""Step metrics (one JSON line per step) and the end-of-run report (JSON plus a PNG plot)."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch


def peak_memory_bytes() -> int:
    """Peak memory of this process: max allocated on the GPU, else the peak RSS of the process."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


class StepLog:
    """Appends one JSON object per step to `path`, flushed at once so a crash loses nothing logged."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = []
        self._file = open(path, "a", encoding="utf-8")

    def append(self, record: dict) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_run_report(output_dir: Path, summary: dict, records: list[dict]) -> tuple[Path, Path]:
    """Write report.json (summary) and report.png (loss and peak memory per step, and saved-activation
    bytes per layer when activations are quantized); return both paths."""
    json_path = output_dir / "report.json"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, json_path)
    png_path = output_dir / "report.png"
    _plot_loss_and_memory(records, summary, png_path)
    return json_path, png_path


def _plot_loss_and_memory(records: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    layers = summary.get("activation_bytes_by_layer")
    fig, axes = plt.subplots(1, 3 if layers else 2, figsize=(16 if layers else 11, 4))
    ax_loss, ax_mem = axes[0], axes[1]
    if layers:
        _plot_activation_bytes(axes[2], layers)
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1)
    ax_loss.set(xlabel="step", ylabel="training loss", title=_loss_title(summary))
    ax_loss.grid(alpha=0.3)
    ax_mem.plot(steps, [r["peak_mem_bytes"] / 2**30 for r in records], lw=1, color="tab:orange")
    ax_mem.set(xlabel="step", ylabel="peak memory (GiB, rank 0)", title=summary.get("memory_kind", "memory"))
    ax_mem.set_ylim(bottom=0)
    ax_mem.grid(alpha=0.3)
    fig.suptitle(f"lazyzero run: model {summary.get('model')}, {summary.get('world_size')} ranks, "
                 f"ZeRO stage {summary.get('zero_stage')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_activation_bytes(axis, layers: dict) -> None:
    """Saved-activation bytes per layer in the last step: what autograd would hold and what is stored."""
    names = list(layers)
    positions = range(len(names))
    saved = [layers[name]["saved_bytes"] / 2**20 for name in names]
    packed = [layers[name]["packed_bytes"] / 2**20 for name in names]
    axis.bar([x - 0.2 for x in positions], saved, width=0.4, label="unpacked")
    axis.bar([x + 0.2 for x in positions], packed, width=0.4, label="stored")
    axis.set_xticks(list(positions), names)
    axis.set(xlabel="layer", ylabel="MiB (rank 0, last step)", title="saved activations")
    axis.legend()


def _loss_title(summary: dict) -> str:
    before, after = summary.get("eval_accuracy_before"), summary.get("eval_accuracy_after")
    if before is None or after is None:
        return "loss"
    return f"loss (eval accuracy {before:.1%} -> {after:.1%})"
