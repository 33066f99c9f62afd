"""The 8-bit optimizer switched on from a shipped config, through the training entry point (2 ranks)."""

import json
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 8-bit states with CPU offload in the default suite: tests/optimizer/test_engine_8bit.py
@pytest.mark.multiproc
def test_shipped_offload_config_trains_with_8bit_states_and_reports_their_bytes(tmp_path):
    argv = ["--module", "lazyzero.train",
            "--deepspeed_config", str(ROOT / "ds_configs" / "cpu_demo_adam8bit_offload.json"),
            "--model", "tiny", "--train-examples", "200", "--eval-problems", "0", "--max-steps", "4",
            "--output-dir", str(tmp_path)]
    proc = run_distributed("deepspeed", 2, argv, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "lazyzero: AdamW8bit: 8-bit Adam states for" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] for r in records)
    # Each rank's moments: 2 bytes per 8-bit element plus scales, 8 per fp32 element; constant over steps.
    assert len({r["optimizer_state_bytes"] for r in records}) == 1 and records[0]["optimizer_state_bytes"] > 0
