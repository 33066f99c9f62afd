"""The demo config with int8 gradients (ds_configs/cpu_demo_int8.json: ZeRO-3, error feedback)
through the training entry point: step metrics in the log, and an exact resume, which needs each
rank's error-feedback residuals restored from the checkpoint."""

import json
import shutil
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "ds_configs" / "cpu_demo_int8.json"


def _train(output_dir: Path, save_dir: Path, *extra: str):
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(CONFIG), "--model", "tiny",
            "--train-examples", "200", "--eval-problems", "0",
            "--output-dir", str(output_dir), "--max-steps", "4", "--save-dir", str(save_dir), *extra]
    proc = run_distributed("deepspeed", 2, argv, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # int8 gradients in multi-rank training: tests/gradients/test_int8_gradients.py
@pytest.mark.multiproc
def test_demo_trains_with_int8_gradients_logs_traffic_and_resumes_exactly(tmp_path):
    full = _train(tmp_path / "full", tmp_path / "ckpt", "--save-every", "2")
    for record in full:
        assert 0 < record["grad_wire_bytes"] <= 0.27 * record["grad_fp32_wire_bytes"]
        assert record["grad_exchange_s"] > 0 and record["grad_overflow"] is False

    # Step 4's gradients are rounded with step 3's residuals: only equal if they were restored.
    resumed_saves = tmp_path / "resume_ckpt"
    shutil.copytree(tmp_path / "ckpt" / "step2", resumed_saves / "step2")
    (resumed_saves / "latest").write_text("step2")
    resumed = _train(tmp_path / "resumed", resumed_saves, "--resume")
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
