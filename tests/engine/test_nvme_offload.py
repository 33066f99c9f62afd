"""ds_configs/cpu_zero3_nvme.json really keeps parameters and optimizer state on NVMe (libaio)."""

import json
import math
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "nvme_worker.py"


# Parameters and optimizer states on NVMe during training are in the default suite:
# tests/plan/test_zero_placement.py and tests/optimizer/test_nvme_8bit.py.
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.skipif(not Path("/usr/include/libaio.h").exists(),
                    reason="NVMe offload needs libaio-dev (.ci/run installs it)")
def test_parameters_and_optimizer_state_are_swap_files_during_training(tmp_path):
    (tmp_path / "nvme").mkdir()
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(tmp_path)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert all(math.isfinite(x) for x in record["losses"])
        files = record["files_during_run"]
        param_files = [f for f, size in files.items() if "param" in f and size > 0]
        optimizer_files = [f for f, size in files.items() if "optimizer" in f and size > 0]
        assert param_files, files
        assert optimizer_files, files
        assert record["param_dtype"] == "torch.bfloat16"
