"""Build and load lazyzero's native kernels: C++ for the CPU, CUDA for GPUs.

The kernels are compiled with ninja through `torch.utils.cpp_extension.load` into shared libraries
whose only content that matters is their `TORCH_LIBRARY_IMPL` registrations: loading one attaches
its kernels to the `torch.ops.lazyzero` schemas defined in Python. Nothing here runs at import;
`ensure_native` builds lazily on the first call of an op, `build` builds on request
(`lazyzero ops build`), and `status` only looks (`lazyzero ops status`).

Libraries are cached under $TORCH_EXTENSIONS_DIR (torch's default cache when unset), in a folder
named after the Python and torch versions; ninja rebuilds only what changed. The CPU library is
compiled with -march=native, so its folder also carries a hash of the CPU's model and feature
flags: a cache shared between different machines (an NFS home) never runs foreign instructions.

When the CPU library cannot be built, the ops fall back to the PyTorch reference after one logged
line naming the reason. On a GPU there is no fallback: a failed CUDA build raises.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import platform
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.utils.cpp_extension as cpp_extension

from lazyzero.ops.stale_locks import clear_stale_build_locks, extension_root

logger = logging.getLogger(__name__)

BACKENDS = ("cpu", "cuda")

# The one list of sources, relative to csrc/, that every build of each backend compiles.
NATIVE_SOURCES = {
    "cpu": ("registration.cpp", "quant/quant_cpu.cpp", "quant/token_blocks_cpu.cpp", "adam8bit/adam_cpu.cpp",
            "norms/rms_norm_cpu.cpp"),
    "cuda": ("quant/quant_cuda.cu", "quant/token_blocks_cuda.cu", "adam8bit/adam_cuda.cu", "norms/rms_norm_cuda.cu"),
}

# -ffp-contract=off: a fused multiply-add rounds once where the reference rounds twice, and the
# kernels must match the reference bit for bit. -fno-trapping-math only lets gcc vectorize floor(),
# -fno-math-errno sqrt() (no errno branch for negative inputs); values are unchanged.
CXX_FLAGS = (
    "-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"
)
LD_FLAGS = ("-fopenmp",)
# --fmad=false for the same reason as -ffp-contract=off; the kernels also use explicit __fmul_rn.
NVCC_FLAGS = ("-O3", "--fmad=false")

# Modules whose import defines the schemas the native kernels attach to.
SCHEMA_MODULES = ("lazyzero.ops.quant", "lazyzero.ops.adam8bit", "lazyzero.ops.norms")

_FAILURE_MARKER = "BUILD_FAILED"

State = Literal["loaded", "built", "not built", "failed", "unavailable"]


@dataclass(frozen=True)
class BackendStatus:
    """Where one backend's native library stands, as `lazyzero ops status` reports it."""

    backend: str
    """"cpu" or "cuda"; for DeepSpeed's ops (lazyzero/ops/deepspeed_ops.py) "ds:" and the op's name."""
    state: State
    """loaded: kernels registered in this process; built: library on disk, not loaded yet;
    not built: nothing stops a build; failed: the last build failed; unavailable: cannot build
    here."""
    path: Path | None
    """The compiled library when one exists on disk."""
    reason: str
    """One line: why the backend is not loaded (empty when it is)."""

    @property
    def usable(self) -> bool:
        return self.state == "loaded"


_lock = threading.Lock()
_loaded: dict[str, BackendStatus] = {}
_attempted: set[str] = set()
_warned_fallback = False


def csrc_dir() -> Path:
    """The repository's csrc/ folder (lazyzero is installed editable from its repository)."""
    path = Path(__file__).resolve().parents[2] / "csrc"
    if not (path / "registration.cpp").is_file():
        raise FileNotFoundError(
            f"lazyzero native sources not found at {path}; install lazyzero from its repository "
            "with `pip install -e .` to build the kernels"
        )
    return path


def library_name(backend: str) -> str:
    return f"lazyzero_{backend}"


@functools.lru_cache(maxsize=1)
def _cpu_tag() -> str:
    """Short hash of the CPU model and instruction-set flags, the inputs of -march=native."""
    cpuinfo = Path("/proc/cpuinfo")
    identity = platform.machine() + platform.processor()
    if cpuinfo.is_file():
        wanted = ("model name", "flags")
        lines = [line for line in cpuinfo.read_text().splitlines() if line.startswith(wanted)]
        identity += "".join(sorted(set(lines)))
    return hashlib.sha256(identity.encode()).hexdigest()[:10]


def build_directory(backend: str) -> Path:
    """Cache folder of one backend's library; honours TORCH_EXTENSIONS_DIR like torch itself."""
    root = extension_root()
    python_tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    torch_tag = "torch" + torch.__version__.replace("+", "_")
    name = library_name(backend) + (f"_{_cpu_tag()}" if backend == "cpu" else "")
    return root / f"lazyzero_{python_tag}_{torch_tag}" / name


def library_path(backend: str) -> Path:
    return build_directory(backend) / f"{library_name(backend)}.so"


def _blocker(backend: str) -> str:
    """Why `backend` cannot be built on this machine, or "" when it can."""
    try:
        csrc_dir()
    except FileNotFoundError as error:
        return str(error)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no compiler ({compiler} not found)"
    if not cpp_extension.is_ninja_available():
        return "no ninja (pip install ninja)"
    if backend == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if cpp_extension.CUDA_HOME is None:
            return "no CUDA toolkit (nvcc not found; set CUDA_HOME)"
    return ""


def _recorded_failure(backend: str) -> str:
    marker = build_directory(backend) / _FAILURE_MARKER
    return marker.read_text().strip() if marker.is_file() else ""


def first_error_line(message: str) -> str:
    """The compiler's first `error` line in a build log, else the log's first non-empty line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower() and not line.startswith("Error building extension"):
            return line
    return lines[0] if lines else "unknown error"


def _current_status(backend: str) -> BackendStatus:
    if backend in _loaded:
        return _loaded[backend]
    library = library_path(backend)
    on_disk = library if library.is_file() else None
    blocker = _blocker(backend)
    if blocker:
        return BackendStatus(backend, "unavailable", on_disk, blocker)
    failure = _recorded_failure(backend)
    if failure:
        return BackendStatus(backend, "failed", on_disk, f"build failed: {failure}")
    if on_disk is not None:
        return BackendStatus(backend, "built", on_disk, "built, not loaded in this process yet")
    return BackendStatus(backend, "not built", None, "not built yet")


def _compile_and_load(backend: str, verbose: bool) -> None:
    """Build (ninja skips what is up to date) and load one backend's library into this process."""
    for module in SCHEMA_MODULES:
        importlib.import_module(module)
    clear_stale_build_locks()
    source_root = csrc_dir()
    cpp_extension.load(
        name=library_name(backend),
        sources=[str(source_root / source) for source in NATIVE_SOURCES[backend]],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(NVCC_FLAGS),
        extra_ldflags=list(LD_FLAGS),
        extra_include_paths=[str(source_root / "include"), str(source_root)],
        build_directory=str(build_directory(backend)),
        verbose=verbose,
        is_python_module=False,
    )


def _load(backend: str, verbose: bool) -> BackendStatus:
    """Try to build and load `backend`; record the outcome on disk and in this process."""
    blocker = _blocker(backend)
    if blocker:
        return BackendStatus(backend, "unavailable", None, blocker)
    directory = build_directory(backend)
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / _FAILURE_MARKER
    try:
        _compile_and_load(backend, verbose)
    except (RuntimeError, OSError, ImportError) as error:
        line = first_error_line(str(error))
        marker.write_text(line + "\n")
        return BackendStatus(backend, "failed", None, f"build failed: {line}")
    marker.unlink(missing_ok=True)
    loaded = BackendStatus(backend, "loaded", library_path(backend), "")
    _loaded[backend] = loaded
    return loaded


def build(verbose: bool = True) -> list[BackendStatus]:
    """Build and load every backend this machine can build; one status per backend."""
    with _lock:
        results = []
        for backend in BACKENDS:
            _attempted.add(backend)
            results.append(_loaded.get(backend) or _load(backend, verbose))
        return results


def status() -> list[BackendStatus]:
    """Where each backend stands, without building anything."""
    with _lock:
        return [_current_status(backend) for backend in BACKENDS]


def format_status(statuses: list[BackendStatus]) -> str:
    """One aligned line per backend: name, state, then the library path or the reason."""
    width = max([5, *(len(entry.backend) for entry in statuses)])
    lines = []
    for entry in statuses:
        detail = str(entry.path) if entry.state == "loaded" and entry.path else entry.reason
        if entry.state == "built":
            detail = f"{entry.path} ({entry.reason})"
        lines.append(f"{entry.backend:<{width}} {entry.state:<12} {detail}")
    return "\n".join(lines)


def ensure_native(device_type: str) -> bool:
    """Load the kernels for `device_type` on first use; True when the native ops can be called.

    cpu: False (after one logged warning naming the reason) when the library cannot be built, and
    the caller uses the PyTorch reference. cuda: raises instead, because a silent fallback on a GPU
    would hide a broken installation behind a much slower path.
    """
    global _warned_fallback
    if device_type not in BACKENDS:
        raise ValueError(f"lazyzero native ops support cpu and cuda tensors, got {device_type!r}")
    with _lock:
        if device_type in _loaded:
            return True
        if device_type not in _attempted:
            _attempted.add(device_type)
            _load(device_type, verbose=False)
        current = _current_status(device_type)
    if current.usable:
        return True
    if device_type == "cuda":
        raise RuntimeError(
            f"lazyzero CUDA kernels unavailable: {current.reason}. There is no fallback on a GPU; "
            "run `lazyzero ops build` for the full build log."
        )
    if not _warned_fallback:
        _warned_fallback = True
        logger.warning("lazyzero native CPU kernels unavailable (%s); using the PyTorch reference",
                       current.reason)
    return False
