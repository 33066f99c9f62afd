import subprocess

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests with a reason where no CUDA device exists (CI has none)."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def small_filesystem(tmp_path):
    """A real 64 KiB tmpfs that a test can fill (tests/checkpoint/test_full_disk.py,
    tests/config/test_nvme_space.py); skipped where mounting needs a privilege this process lacks."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)
