"""A run larger than memory (docs/plan.md, "Planning partitioned models"): the `1b` preset, built
partitioned by `lazyzero train`, trains through the planner on 2 ranks under the shipped
`ds_configs/cpu_1b_planned.json`, whose budget per rank is measured on the machine and is a fraction of
the run's training state; NVMe holds the rest. About 10 minutes and 12 GB of NVMe folder here, so slow.
`benchmarks/bench_planner.py --larger-than-memory-only` measures the same run's figures."""

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
NVME_FOLDER, NVME_ROOM = Path("/var/tmp"), 12 * 10**9
STEPS, SEQ_LEN = 5, 64
MIXED_PRECISION_ADAM_BYTES = 16  # bf16 parameter and gradient, fp32 master and two moments


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_1b_preset_trains_through_the_planner_under_a_fraction_of_its_state(tmp_path):
    from lazyzero.config.async_io import async_io_unavailable

    if async_io_unavailable() is not None or shutil.disk_usage(NVME_FOLDER).free < NVME_ROOM:
        pytest.skip(f"needs DeepSpeed's async_io and {NVME_ROOM / 1e9:.0f} GB free under {NVME_FOLDER}")
    # DeepSpeed leaves its swap files behind: a folder of the test's own, removed after it.
    nvme = tempfile.mkdtemp(prefix="lazyzero_test_", dir=NVME_FOLDER)
    config = json.loads((ROOT / "ds_configs" / "cpu_1b_planned.json").read_text())
    config["lazyzero"]["plan"].update(nvme_path=nvme, output_dir=str(tmp_path / "plan"),
                                      profile_path=str(tmp_path / "profile.json"))
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(tmp_path / "ds_config.json"), "--model", "1b",
            "--seq-len", str(SEQ_LEN), "--max-steps", str(STEPS), "--eval-problems", "0", "--output-dir", str(out)]
    try:
        proc = run_distributed("deepspeed", 2, argv, cwd=ROOT, timeout=2400)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-6000:]
    report = json.loads((out / "report.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    budget = report["compute_budget_per_rank_bytes"]
    state_per_rank = report["parameters"] * MIXED_PRECISION_ADAM_BYTES / report["world_size"]

    assert state_per_rank > 2 * budget, (state_per_rank, budget)
    assert len(records) == STEPS and all(math.isfinite(r["loss"]) for r in records)
    assert max(r["peak_mem_bytes"] for r in records) <= budget, "the run left its planned budget"
    first_check = report["plan_checks"][0]
    assert abs(first_check["peak_error"]) <= 0.15, first_check
