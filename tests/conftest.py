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
