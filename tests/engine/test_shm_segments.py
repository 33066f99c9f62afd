"""DeepSpeed's CPU all-reduce leaves a 66 MB /dev/shm file per rank; lazyzero.initialize removes
the names once every rank has mapped them, and training goes on (lazyzero/distributed/shm_segments.py)."""

import json
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "shm_worker.py"


@pytest.mark.multiproc
def test_initialize_releases_deepspeeds_shared_memory_files(tmp_path):
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts["segments_before"] == 2, "DeepSpeed no longer creates the files: is the fix still needed?"
        assert facts["segments_after"] == 0
        assert facts["all_reduce_finite"]
