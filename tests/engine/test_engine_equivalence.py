"""With the "lazyzero" section absent or all features off, lazyzero is DeepSpeed bit for bit."""

import json
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "equivalence_worker.py"
# One launch runs the settings given; stages 0 and 3 with and without offload are the default suite.
DEFAULT_SETTINGS = ["0", "3", "2+cpu"]
SLOW_SETTINGS = ["1", "2", "3+cpu"]


def check_equal_to_plain_deepspeed(out: Path, settings: list[str]) -> None:
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(out), *settings], timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        result = json.loads((out / f"rank{rank}.json").read_text())
        for stage in settings:
            runs = result[stage]
            assert runs["engines"] == ["DeepSpeedEngine", "LazyZeroEngine"]
            assert len(runs["deepspeed"]) == 10
            # Exact float equality on purpose: the same code must run (TOLERANCES["engine_features_off"]).
            assert runs["lazyzero"] == runs["deepspeed"], f"stage {stage}, rank {rank}"
            assert runs["deepspeed"][0] != runs["deepspeed"][-1], "training did not move the loss"


@pytest.mark.multiproc
def test_losses_equal_plain_deepspeed_on_stages_0_and_3_and_with_cpu_offload(tmp_path):
    check_equal_to_plain_deepspeed(tmp_path, DEFAULT_SETTINGS)


@pytest.mark.slow
@pytest.mark.multiproc
def test_losses_equal_plain_deepspeed_on_the_other_stages_and_offloads(tmp_path):
    check_equal_to_plain_deepspeed(tmp_path, SLOW_SETTINGS)
