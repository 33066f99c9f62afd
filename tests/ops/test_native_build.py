"""Native build bookkeeping: status without building, failure reporting, CPU fallback, no GPU
fallback. The compiler is replaced by a stub that fails, so nothing here compiles."""

import logging

import pytest
import torch
from quant_samples import varied_magnitudes

from lazyzero.ops import native_build, quant_reference
from lazyzero.ops.quant import quantize_blockwise

COMPILER_LOG = (
    "Error building extension 'lazyzero_cpu': [1/3] c++ -MMD -c quant_cpu.cpp\n"
    "FAILED: quant_cpu.o\n"
    "/work/csrc/quant/quant_cpu.cpp:12:3: error: 'vec' was not declared in this scope\n"
    "/work/csrc/quant/quant_cpu.cpp:20:1: error: expected ';'\n"
)


@pytest.fixture
def fresh_build_state(tmp_path, monkeypatch):
    """An empty extension cache and a process that has loaded and tried nothing yet."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", {})
    monkeypatch.setattr(native_build, "_attempted", set())
    monkeypatch.setattr(native_build, "_warned_fallback", False)
    return tmp_path


@pytest.fixture
def failing_compiler(monkeypatch):
    def fail(backend, verbose):
        raise RuntimeError(COMPILER_LOG)

    monkeypatch.setattr(native_build, "_compile_and_load", fail)


def cpu_status() -> native_build.BackendStatus:
    return next(entry for entry in native_build.status() if entry.backend == "cpu")


def test_build_directory_honours_torch_extensions_dir(fresh_build_state):
    assert native_build.library_path("cpu").is_relative_to(fresh_build_state)
    assert native_build.library_path("cpu").name == "lazyzero_cpu.so"


def test_status_reports_not_built_without_building(fresh_build_state):
    assert cpu_status().state == "not built"
    assert cpu_status().reason == "not built yet"
    assert not any(fresh_build_state.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_status_says_why_cuda_is_unavailable(fresh_build_state):
    cuda = next(entry for entry in native_build.status() if entry.backend == "cuda")
    assert (cuda.state, cuda.reason) == ("unavailable", "no CUDA device")
    with pytest.raises(RuntimeError, match="no CUDA device.*no fallback on a GPU"):
        native_build.ensure_native("cuda")


def test_first_error_line_finds_the_compiler_error():
    expected = "/work/csrc/quant/quant_cpu.cpp:12:3: error: 'vec' was not declared in this scope"
    assert native_build.first_error_line(COMPILER_LOG) == expected
    assert native_build.first_error_line("linker exploded\nmore") == "linker exploded"


def test_failed_build_is_reported_and_remembered(fresh_build_state, failing_compiler):
    results = native_build.build(verbose=False)
    cpu = next(entry for entry in results if entry.backend == "cpu")
    assert cpu.state == "failed"
    assert cpu.reason.startswith("build failed: /work/csrc/quant/quant_cpu.cpp:12:3: error:")
    assert cpu_status().reason == cpu.reason
    assert "cpu   failed       build failed:" in native_build.format_status(results)


def test_cpu_falls_back_to_reference_with_one_warning(fresh_build_state, failing_compiler, caplog):
    x = varied_magnitudes(3000)
    with caplog.at_level(logging.WARNING, logger=native_build.__name__):
        first = quantize_blockwise(x, block_size=128, stochastic=True, seed=4)
        quantize_blockwise(x, block_size=128)
    warnings = [r.getMessage() for r in caplog.records if r.name == native_build.__name__]
    assert len(warnings) == 1
    assert "using the PyTorch reference" in warnings[0] and "error: 'vec'" in warnings[0]
    codes, scales = quant_reference.quantize_int8(x, 128, True, 4)
    assert torch.equal(first.codes, codes) and torch.equal(first.scales, scales)


def test_ensure_native_rejects_other_devices():
    with pytest.raises(ValueError, match="cpu and cuda"):
        native_build.ensure_native("xpu")
