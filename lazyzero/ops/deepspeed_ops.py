"""Build ahead the DeepSpeed ops that lazyzero runs load, so that no run stalls minutes on their compile.

DeepSpeed compiles its C++ ops with ninja on first use, into torch's extension cache: CPU Adam for an
offloaded optimizer, fused Adam, the shared-memory collectives of its CPU accelerator, and async_io
for every NVMe path. Measured on a 2-core Intel Xeon from an empty cache: cpu_adam 49 s, fused_adam
43 s, deepspeed_shm_comm 34 s, async_io 169 s, about five minutes in all, spent inside the first
training step or test that needs each one, with nothing on screen. `lazyzero ops build` builds them
with lazyzero's own kernels (lazyzero/ops/native_build.py), through DeepSpeed's accelerator, so each
machine gets the builders its runs will use (docs/deepspeed-internals.md).
"""

from __future__ import annotations

from lazyzero.config.async_io import LIBAIO_INSTALL
from lazyzero.ops.native_build import BackendStatus, first_error_line
from lazyzero.ops.stale_locks import clear_stale_build_locks

# The builders of lazyzero runs' DeepSpeed ops, by DeepSpeed's builder class names.
RUN_OP_BUILDERS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder")


def _unavailable_reason(builder_name: str) -> str:
    if builder_name == "AsyncIOBuilder":
        return f"libaio is missing (NVMe needs it: {LIBAIO_INSTALL})"
    return "DeepSpeed says it cannot be built on this machine"


def build_one(builder_name: str, verbose: bool) -> BackendStatus:
    """Build (or find cached) one DeepSpeed op; its status as `lazyzero ops build` prints it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    try:
        builder = accelerator.create_op_builder(builder_name)
    except (AttributeError, ImportError, ValueError) as error:
        builder, why = None, f"{type(error).__name__}: {error}"
    else:
        why = f"not an op of DeepSpeed's {accelerator.device_name()} accelerator"
    if builder is None:
        return BackendStatus(builder_name, "unavailable", None, why)
    label = f"ds:{builder.name}"
    if not builder.is_compatible(verbose=False):
        return BackendStatus(label, "unavailable", None, _unavailable_reason(builder_name))
    clear_stale_build_locks()
    try:
        builder.load(verbose=verbose)
    except ValueError as error:  # DeepSpeed's stand-in builder for an op its accelerator lacks
        return BackendStatus(label, "unavailable", None, str(error))
    except (RuntimeError, OSError, ImportError) as error:
        return BackendStatus(label, "failed", None, f"build failed: {first_error_line(str(error))}")
    return BackendStatus(label, "loaded", None, "in torch's extension cache")


def build_run_ops(verbose: bool = True) -> list[BackendStatus]:
    """Build every DeepSpeed op a lazyzero run may load on this machine's accelerator."""
    return [build_one(name, verbose) for name in RUN_OP_BUILDERS]
