"""Compile-only check of the CUDA kernels: nvcc must accept every .cu file with torch's headers.

It needs nvcc, not a GPU, so CPU-only machines still catch CUDA compile errors. The flags are the
ones the real build uses (lazyzero.ops.native_build.NVCC_FLAGS and torch's own nvcc flags), for sm_90.
One nvcc call per .cu file, all started at once (each takes about half a minute here, most of it
parsing torch's headers on one core, so side by side they take the time of one).
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


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """source -> (nvcc's exit status, its stderr, the object file), every source compiled at once."""
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("nvcc")
    running = {}
    for index, source in enumerate(CUDA_SOURCES):
        output, log = out / f"kernel{index}.o", out / f"kernel{index}.log"
        # stderr to a file: a pipe left unread while waiting on another nvcc could fill and block it.
        with log.open("w") as stderr:
            process = subprocess.Popen(nvcc_command(native_build.csrc_dir() / source, output),
                                       stdout=subprocess.DEVNULL, stderr=stderr)
        running[source] = (process, output, log)
    results = {}
    for source, (process, output, log) in running.items():
        process.wait(timeout=900)
        results[source] = (process.returncode, log.read_text(), output)
    return results


@pytest.mark.parametrize("source", CUDA_SOURCES)
def test_cuda_source_compiles(source, compiled):
    returncode, stderr, output = compiled[source]
    assert returncode == 0, f"nvcc failed:\n{stderr[-6000:]}"
    assert output.stat().st_size > 0
