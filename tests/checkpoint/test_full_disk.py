"""A lazy checkpoint that cannot fit on its filesystem fails before writing anything, naming the folder,
the bytes needed and the bytes free, on every rank; training goes on (docs/reliability.md, guarantee 4).
The filesystem is a real tmpfs of 64 KiB that the checkpoint (about 280 KB per rank) would overfill."""

import json
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "full_disk_worker.py"


@pytest.mark.multiproc
def test_a_checkpoint_larger_than_the_free_space_fails_before_writing(small_filesystem, tmp_path):
    save_dir = small_filesystem / "save"
    results = tmp_path / "results"
    results.mkdir()
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(save_dir), str(results)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in (0, 1):
        result = json.loads((results / f"rank{rank}.json").read_text())
        assert result["error"] == "CheckpointFailedError" and result["trained_after"], result
        assert "not enough space for this rank's checkpoint files" in result["message"], result
        assert f"free on the filesystem of {save_dir}/.lazyzero-tmp.step1" in result["message"], result
    # Only DeepSpeed's recovery scripts, which its save copies into save_dir before any state is written.
    written = sorted(path.relative_to(save_dir).as_posix() for path in small_filesystem.rglob("*") if path.is_file())
    assert written == ["zero_to_fp32.py", "zero_to_torch.py"], written
    assert [path.name for path in save_dir.iterdir() if path.is_dir()] == []
