"""docs/reliability.md, what is tested: every capability on at once trains as plain DeepSpeed does.

Two real 2-rank `lazyzero train` runs of the demo model (19M parameters, ZeRO-3, the same data, seed
and steps): plain DeepSpeed (ds_configs/cpu_demo.json) and the quick start's planned config
(ds_configs/cpu_demo_planned.json: the planner, int8 gradients with error feedback, lazy checkpoints
saved every 10 steps), with recompute disallowed, so that the planner meets its budget by storing
activations at 8 bits; it gives 8-bit Adam states too. The test checks that each capability is
really on, then bounds the loss.
"""

import json
import math
from pathlib import Path

import pytest

from lazyzero.testing import TOLERANCES, run_distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60
TAIL = 10
FEATURES = ["plan", "activations", "gradients", "optimizer", "checkpoint"]


def _train(tmp_path: Path, name: str, config: Path, *extra: str) -> tuple[list[float], dict]:
    out = tmp_path / name
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(config), "--model", "demo",
            "--max-steps", str(STEPS), "--train-examples", "1000", "--eval-problems", "0",
            "--output-dir", str(out), *extra]
    proc = run_distributed("deepspeed", 2, argv, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return losses, json.loads((out / "report.json").read_text())


def _every_feature_config(tmp_path: Path) -> Path:
    config = json.loads((ROOT / "ds_configs" / "cpu_demo_planned.json").read_text())
    config["lazyzero"]["plan"].update(output_dir=str(tmp_path / "plan"), allow_recompute=False)
    path = tmp_path / "every_feature.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_feature_on_ends_where_plain_deepspeed_ends(tmp_path):
    plain, _ = _train(tmp_path, "deepspeed", ROOT / "ds_configs" / "cpu_demo.json")
    losses, report = _train(tmp_path, "lazyzero", _every_feature_config(tmp_path),
                            "--save-every", "10", "--save-dir", str(tmp_path / "checkpoints"))

    assert report["lazyzero_features"] == FEATURES
    layers = report["plan"]["layers"]
    assert any(layer["act_mode"] == "keep" and layer["act_bits"] < 16 for layer in layers), layers
    assert any(layer["state_8bit"] for layer in layers), layers
    assert any(entry["packed_bytes"] < entry["saved_bytes"] for entry in report["activation_bytes_by_layer"].values())
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step{STEPS}"

    assert len(losses) == len(plain) == STEPS and all(math.isfinite(loss) for loss in losses)
    tail = sum(losses[-TAIL:]) / TAIL
    assert tail < 0.5 * sum(losses[:5]) / 5, losses
    ratio = tail / (sum(plain[-TAIL:]) / TAIL)
    assert ratio <= TOLERANCES["every_feature_vs_deepspeed_loss"], (ratio, losses, plain)
