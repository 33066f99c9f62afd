"""Machine measurements of the planner's profile: copy paths, optimizer steps, collectives (docs/plan.md).

Every figure is what one training rank sees, measured while all ranks of the job measure the same
thing at once (ranks of one host share its cores, memory bus and disk, as they do in training).

- host memory copy: one large `copy_` between two host tensors;
- NVMe write and read: DeepSpeed's aio handle (`AsyncIOBuilder`), with the settings of a DeepSpeed
  config's "aio" section, page-locked buffers from the handle (as DeepSpeed's swappers allocate
  them), sizes rounded to the block size and the swappers' alignment, one file per rank, removed
  afterwards. aio opens files with O_DIRECT, so reads come from the device, not the page cache;
- on CUDA: host-to-device and device-to-host copies from and to pinned memory;
- optimizer steps: torch.optim.AdamW with torch's default implementation (what DeepSpeed builds
  from an AdamW section with "torch_adam"), DeepSpeedCPUAdam with fp32 states (ZeRO-Offload's),
  lazyzero's AdamW8bit;
- ZeRO-3's collectives through deepspeed.comm (`allgather_fn`, `reduce_scatter_fn`), the calls
  ZeRO-3 makes, on a buffer the size of one decoder layer's parameters; and lazyzero's int8
  reduce-scatter (`lazyzero.gradients`, docs/gradients.md) of the same buffer, without and with
  error feedback, which replaces ZeRO-3's when `gradients` is on.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lazyzero.gradients.quantized_reduce_scatter import ExchangeBuffers, quantized_reduce_scatter
from lazyzero.ops.native_build import ensure_native
from lazyzero.optimizer.adam8bit_optimizer import AdamW8bit
from lazyzero.plan.profile.data import Bandwidth, CollectiveSpeed, NvmeSetup, OptimizerSpeed
from lazyzero.plan.profile.measure import median_seconds, synchronize

HYPERPARAMETERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
OPTIMIZER_TENSORS = 4
# Gradients of a trained model's magnitude, far from fp32 subnormals (which would slow every case).
GRADIENT_STD = 1e-2
PROFILE_FILE_PREFIX = "lazyzero_profile_"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_copy(nbytes: int, repeats: int, warmup: int) -> Bandwidth:
    """Bytes copied per second by one `copy_` of `nbytes` between host tensors (fp32)."""
    source = torch.ones(max(1, nbytes // 4))
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), repeats, warmup, torch.device("cpu"))
    moved = source.numel() * 4
    return Bandwidth(moved / seconds, moved, seconds)


def device_copies(device: torch.device, nbytes: int, repeats: int, warmup: int) -> dict[str, Bandwidth]:
    """h2d and d2h between pinned host memory and `device` (CUDA only)."""
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    cases = {"h2d": lambda: on_device.copy_(host, non_blocking=True),
             "d2h": lambda: host.copy_(on_device, non_blocking=True)}
    results = {}
    for name, work in cases.items():
        seconds = median_seconds(work, repeats, warmup, device)
        results[name] = Bandwidth(nbytes / seconds, nbytes, seconds)
    return results


def aio_settings(ds_config: dict | None) -> dict:
    """DeepSpeed's aio settings from a config's "aio" section (its defaults where absent)."""
    from deepspeed.runtime.swap_tensor.aio_config import get_aio_config

    return dict(get_aio_config(ds_config or {}))


def aio_unavailable_reason() -> str | None:
    """Why DeepSpeed's async_io op cannot be built here (None when it can)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return (None if AsyncIOBuilder().is_compatible(verbose=False)
            else "DeepSpeed's async_io op cannot be built here (libaio missing?)")


def check_nvme_folder(path: str) -> Path:
    """`path` as an absolute folder that exists and is writable, else ValueError naming it."""
    folder = Path(path).resolve()
    if not folder.is_dir():
        raise ValueError(f"nvme path {path}: not an existing folder")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"nvme path {path}: not writable")
    return folder


def _aio_file_bytes(nbytes: int, aio: dict) -> int:
    """`nbytes` rounded up to whole aio blocks and to the swappers' alignment (1 KiB per thread)."""
    from deepspeed.runtime.swap_tensor.utils import AIO_ALIGNED_BYTES

    unit = math.lcm(aio["block_size"], AIO_ALIGNED_BYTES * aio["intra_op_parallelism"])
    return max(1, math.ceil(nbytes / unit)) * unit


def nvme_bandwidths(path: str, nbytes: int, aio: dict, repeats: int,
                    warmup: int) -> tuple[dict[str, Bandwidth], NvmeSetup]:
    """Write then read one file of about `nbytes` in the folder `path` through DeepSpeed aio."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    folder = check_nvme_folder(path)
    handle = AsyncIOBuilder().load(verbose=False).aio_handle(
        aio["block_size"], aio["queue_depth"], aio["single_submit"], aio["overlap_events"], aio["intra_op_parallelism"])
    size = _aio_file_bytes(nbytes, aio)
    example = torch.empty(0, dtype=torch.uint8)
    written, read = handle.new_cpu_locked_tensor(size, example), handle.new_cpu_locked_tensor(size, example)
    file = folder / f"{PROFILE_FILE_PREFIX}{os.getpid()}.swp"
    try:
        written.copy_(torch.arange(size, dtype=torch.int64).remainder_(251).to(torch.uint8))
        write_s = median_seconds(lambda: _aio_wait(handle, handle.async_pwrite(written, str(file)), file), repeats,
                                 warmup, torch.device("cpu"))
        read_s = median_seconds(lambda: _aio_wait(handle, handle.async_pread(read, str(file)), file), repeats, warmup,
                                torch.device("cpu"))
        if not torch.equal(written, read):
            raise RuntimeError(f"aio read back other bytes than it wrote in {file}")
    finally:
        file.unlink(missing_ok=True)
        handle.free_cpu_locked_tensor(written)
        handle.free_cpu_locked_tensor(read)
    bandwidths = {"nvme_write": Bandwidth(size / write_s, size, write_s),
                  "nvme_read": Bandwidth(size / read_s, size, read_s)}
    return bandwidths, NvmeSetup(str(folder), dict(aio), size)


def _aio_wait(handle, submitted: int, file: Path) -> None:
    if submitted != 0 or handle.wait() != 1:
        raise OSError(f"DeepSpeed aio failed on {file}")


def _parameters(elements: int, device: torch.device, seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    size = max(1, elements // OPTIMIZER_TENSORS)
    params = []
    for _ in range(OPTIMIZER_TENSORS):
        param = torch.nn.Parameter((torch.randn(size, generator=generator) * 2e-2).to(device))
        param.grad = (torch.randn(size, generator=generator) * GRADIENT_STD).to(device)
        params.append(param)
    return params


def _torch_adamw(params):
    return torch.optim.AdamW(params, **HYPERPARAMETERS), "torch"


def _deepspeed_cpu_adam(params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds its C++ op on first use

    return DeepSpeedCPUAdam(params, adamw_mode=True, fp32_optimizer_states=True, **HYPERPARAMETERS), "deepspeed"


def _lazyzero_adamw8bit(params):
    native = ensure_native(params[0].device.type)
    return AdamW8bit(params, **HYPERPARAMETERS), "native" if native else "reference"


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of state tensors other than 0-dim step counters (moments, codes, scales)."""
    if hasattr(optimizer, "state_bytes"):
        return optimizer.state_bytes()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)


def optimizer_cases(device: torch.device) -> dict[str, tuple[Callable, torch.device]]:
    """Name -> (factory, device) of every optimizer the profile times."""
    cpu = torch.device("cpu")
    cases = {"torch_adamw": (_torch_adamw, device), "deepspeed_cpu_adam": (_deepspeed_cpu_adam, cpu),
             "lazyzero_adamw8bit": (_lazyzero_adamw8bit, cpu)}
    if device.type == "cuda":  # the 8-bit step runs on the device, or on the host under optimizer offload
        cases["lazyzero_adamw8bit_cuda"] = (_lazyzero_adamw8bit, device)
    return cases


def optimizer_speeds(elements: int, repeats: int, warmup: int, device: torch.device,
                     seed: int) -> tuple[dict[str, OptimizerSpeed], dict[str, str]]:
    """Step time of each optimizer over `elements` fp32 parameters; (speeds, name -> why skipped)."""
    speeds, skipped = {}, {}
    for name, (factory, where) in optimizer_cases(device).items():
        params = _parameters(elements, where, seed)
        try:
            optimizer, backend = factory(params)
            optimizer.step()  # creates the state (and builds any JIT op) before timing
        except Exception as error:  # any failure means "not available here"; the rest is still measured
            skipped[f"optimizer {name}"] = f"{type(error).__name__}: {error}".splitlines()[0]
            continue
        seconds = median_seconds(optimizer.step, repeats, warmup, where)
        numel = sum(p.numel() for p in params)
        state = _state_bytes(optimizer)
        speeds[name] = OptimizerSpeed(str(where), numel, seconds, seconds / numel, state / numel,
                                      seconds / state if state else 0.0, backend)
        del optimizer, params
    return speeds, skipped


def ensure_deepspeed_comm() -> None:
    """deepspeed.comm on top of an initialized torch.distributed (ZeRO's collectives go through it)."""
    import deepspeed
    import deepspeed.comm as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())


def collective_speeds(numel: int, dtype: torch.dtype, device: torch.device, repeats: int,
                      warmup: int) -> dict[str, CollectiveSpeed]:
    """ZeRO-3's all-gather (partition -> whole) and reduce-scatter (whole -> partition) of a
    `numel`-element buffer on the default group; every rank starts each run after a barrier."""
    import deepspeed.comm as dist

    ensure_deepspeed_comm()
    world = dist.get_world_size()
    part = math.ceil(numel / world)
    full = part * world
    shard, whole = torch.randn(part).to(device, dtype), torch.randn(full).to(device, dtype)
    gathered, scattered = torch.empty_like(whole), torch.empty_like(shard)
    cases = {"all_gather": lambda: dist.allgather_fn(gathered, shard),
             "reduce_scatter": lambda: dist.reduce_scatter_fn(scattered, whole), **_int8_cases(whole)}
    full_bytes = full * whole.element_size()
    results = {}
    for name, work in cases.items():
        seconds = _collective_seconds(work, repeats, warmup, device)
        results[name] = CollectiveSpeed(world, str(dtype).removeprefix("torch."), full_bytes, seconds,
                                        seconds / full_bytes)
    return results


def _int8_cases(whole: torch.Tensor) -> dict[str, Callable]:
    """lazyzero's int8 reduce-scatter of `whole` as the gradient exchange calls it (scratch buffers
    reused, the default block size), without and with an error-feedback residual."""
    buffers, residual = ExchangeBuffers(), torch.zeros(whole.numel(), dtype=torch.float32, device=whole.device)
    return {"int8_reduce_scatter": lambda: quantized_reduce_scatter(whole, buffers=buffers),
            "int8_reduce_scatter_error_feedback": lambda: quantized_reduce_scatter(whole, buffers=buffers,
                                                                                   residual=residual)}


def _collective_seconds(work: Callable, repeats: int, warmup: int, device: torch.device) -> float:
    import deepspeed.comm as dist

    times = []
    for run in range(warmup + repeats):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        if run >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
