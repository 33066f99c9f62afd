"""Compile-only check of the CUDA kernels: nvcc must accept every .cu file with torch's headers.

It needs nvcc, not a GPU, so CPU-only machines still catch CUDA compile errors. The flags are the
ones the real build uses (lazyzero.ops.native_build.NVCC_FLAGS and torch's own nvcc flags), for sm_90.
One nvcc call per .cu file; each takes about a minute, most of it parsing torch's headers.
"""

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

from lazyzero.ops import native_build

CUDA_SOURCES = native_build.NATIVE_SOURCES["cuda"]
TORCH_INCLUDE = Path(cpp_extension.include_paths()[0])


def cuda_home() -> Path:
    return Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def find_nvcc() -> str | None:
    return shutil.which("nvcc") or shutil.which(str(cuda_home() / "bin" / "nvcc"))


def missing_prerequisite() -> str:
    """Why this machine cannot run the check, or "" when it can."""
    if find_nvcc() is None:
        return "nvcc not found (put it on PATH or set CUDA_HOME)"
    if not (cuda_home() / "include" / "cuda_runtime.h").is_file():
        return f"CUDA headers not found under {cuda_home()} (set CUDA_HOME)"
    if not (TORCH_INCLUDE / "c10" / "cuda" / "CUDAStream.h").is_file():
        return "this torch installation ships no c10/cuda headers"
    return ""


def nvcc_command(source: Path, output: Path) -> list[str]:
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    includes += [str(native_build.csrc_dir() / "include"), str(native_build.csrc_dir())]
    defines = []
    # CPU builds of torch omit this generated header; its only content is the export switch of a
    # shared c10_cuda library, which this define skips. CUDA builds of torch ship it.
    if not (TORCH_INCLUDE / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").is_file():
        defines.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return [
        find_nvcc(),
        "-c",
        str(source),
        "-o",
        str(output),
        # torch >= 2.10 headers need C++20, as torch's own extension builds use.
        "-std=c++20",
        "-arch=sm_90",
        "-Xcompiler",
        "-fPIC",
        *native_build.NVCC_FLAGS,
        *cpp_extension.COMMON_NVCC_FLAGS,
        *defines,
        *(f"-I{path}" for path in includes),
    ]


@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_cuda_source_compiles(source, tmp_path):
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    command = nvcc_command(native_build.csrc_dir() / source, tmp_path / "kernel.o")
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"nvcc failed:\n{result.stderr[-6000:]}"
    assert (tmp_path / "kernel.o").stat().st_size > 0
