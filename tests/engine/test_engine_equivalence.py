"""With the "lazyzero" section absent or all features off, lazyzero is DeepSpeed bit for bit."""

import json
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "equivalence_worker.py"
SETTINGS = ["0", "1", "2", "3", "2+cpu", "3+cpu"]


@pytest.mark.multiproc
def test_losses_equal_plain_deepspeed_on_every_stage_with_and_without_cpu_offload(tmp_path):
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(tmp_path), *SETTINGS], timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for stage in SETTINGS:
            runs = result[stage]
            assert runs["engines"] == ["DeepSpeedEngine", "LazyZeroEngine"]
            assert len(runs["deepspeed"]) == 10
            # Exact float equality on purpose: the same code must run (TOLERANCES["engine_features_off"]).
            assert runs["lazyzero"] == runs["deepspeed"], f"stage {stage}, rank {rank}"
            assert runs["deepspeed"][0] != runs["deepspeed"][-1], "training did not move the loss"
