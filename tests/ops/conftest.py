"""Fixtures of the op tests: the native CPU kernels, built once per session."""

import pytest

from lazyzero.ops import native_build


@pytest.fixture(scope="session")
def native_cpu() -> None:
    """Loads the C++ CPU kernels; skips only where this machine cannot compile at all.

    A failed build is an error, not a skip: the kernels are part of the project.
    """
    if not native_build.ensure_native("cpu"):
        current = next(entry for entry in native_build.status() if entry.backend == "cpu")
        if current.state == "unavailable":
            pytest.skip(f"native CPU kernels cannot be built here: {current.reason}")
        pytest.fail(f"native CPU kernels failed to build: {current.reason}")
