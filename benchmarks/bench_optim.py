"""Step throughput and state size of lazyzero's fused 8-bit AdamW against other optimizers.

100M fp32 parameters in 4 tensors of 25M (the 8-bit step's cost is per element, so a few large
tensors, like a transformer's weight matrices, stand for a model partition). Every optimizer gets
its own copy of the parameters and the same hyperparameters; all share one set of random
gradients, which none of them modifies (400 MB saved per optimizer, and the same input for all).
Cases, timed interleaved in one run (`common.median_seconds`):

- `lazyzero_adamw8bit`: AdamW8bit.step() with `grad_scale` 1.
- `lazyzero_adamw8bit_clipped`: what the engine does on a clipped step: the fused global norm
  (`clipping.global_grad_norm`, no cross-rank reduction), the clip factor as `grad_scale`, the step.
- `lazyzero_grad_norm`: the norm alone, to explain the clipping overhead.
- `deepspeed_cpu_adam`: DeepSpeedCPUAdam (AdamW mode, fp32 states), ZeRO-Offload's optimizer.
- `torch_adamw_foreach`, `torch_adamw_fused`: torch.optim.AdamW; the faster of the two is the
  baseline of `speed_ratio_vs_torch_adamw` (fused is skipped, with the reason, where unsupported).
- `bitsandbytes_adamw8bit`: only where bitsandbytes imports and its 8-bit AdamW runs on CPU tensors;
  otherwise the reason is recorded under `skipped`.

All CPU cases run on the same thread count (`--threads`, default: every core). With CUDA, our
AdamW8bit is also timed against torch's fused AdamW on the GPU, and bitsandbytes' AdamW8bit where it
imports (keys prefixed `gpu_`); `gpu_bandwidth_fraction` is our step's bytes moved per second (each
element's parameter, gradient and 8-bit moments read, parameter and moments written: `STEP_BYTES_PER_PARAM`)
over a device-to-device copy's (bytes read plus written), timed in the same run. `--gpu-only` times just
that part (benchmarks/gpu_checks.sh).

`clip_overhead` above counts the norm pass as clipping's cost. A DeepSpeed engine computes the
global norm on every step whether it clips or not (it reports it, and the 8-bit engine skips a step
on a non-finite norm), so what switching `gradient_clipping` on costs in training is what comes on
top of that. `engine_clip_overhead` measures it: one rank, ZeRO-2, the same 100M parameters as 4
linear layers, `engine.step()` timed with the clip threshold set low enough that every step clips,
against the same engine with it at 0 in the next step (pairs in the order ABBA; the key is the
median of the pairs' ratios, since one step's time varies by 10-30% here); once with lazyzero's
8-bit optimizer and fused clipping, once with DeepSpeed's own AdamW and clip pass
(`engine_clip_overhead_deepspeed`).
Targets (docs/optimizer.md): speed_ratio_vs_ds_cpu_adam >= 1, speed_ratio_vs_torch_adamw >= 3,
state_bytes_per_param <= 2.1, clip_overhead <= 1.05.

    python benchmarks/bench_optim.py --quick --out benchmarks/results/bench_optim.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import median_seconds, pin_threads, write_results  # noqa: E402

from lazyzero.ops import native_build  # noqa: E402
from lazyzero.optimizer import AdamW8bit, clipping  # noqa: E402
from lazyzero.testing import destroy_engine, free_port  # noqa: E402

PARAMETERS = 100_000_000
TENSORS = 4
HYPERPARAMETERS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
# Gradients of a trained model's magnitude: with max norm 1 the clip factor is about 1e-2, so the
# scaled gradients and their squares stay far from fp32 subnormals (which would slow every case).
GRADIENT_STD = 1e-2
PARAMETER_STD = 2e-2
MAX_GRAD_NORM = 1.0
LOSS_SCALE = 1.0
TORCH_ADAMW_VARIANTS = ("torch_adamw_foreach", "torch_adamw_fused")
ENGINE_BATCH = 8
# Far below the gradients' norm (recorded as engine_grad_norm), so that every clipped step clips.
ENGINE_CLIP = 1e-6
# Bytes one step reads and writes per fp32 parameter: parameter and gradient read (8), parameter
# written (4), and the two moments read and written (8-bit: 2 x 2 bytes and their fp32 block scales;
# fp32: 2 x 8 bytes).
_SCALES = 2 * 2 * 4 / 256
STEP_BYTES_PER_PARAM = {"lazyzero_adamw8bit": 12 + 4 + _SCALES, "bitsandbytes_adamw8bit": 12 + 4 + _SCALES,
                        "torch_adamw_fused": 12 + 16}

Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats; same sizes")
    parser.add_argument("--out", type=Path, help="write the results as JSON to this file")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of every CPU optimizer")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU cases (needs CUDA)")
    return parser.parse_args()


def random_tensors(device: str, std: float, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    size = PARAMETERS // TENSORS
    return [torch.randn(size, generator=generator, device=device).mul_(std) for _ in range(TENSORS)]


def parameter_copies(initial: list[torch.Tensor], gradients: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """A fresh copy of the parameters whose .grad are the shared `gradients`."""
    params = [torch.nn.Parameter(tensor.clone()) for tensor in initial]
    for param, grad in zip(params, gradients):
        param.grad = grad
    return params


def lazyzero_cases(optimizer: AdamW8bit) -> dict[str, Callable[[], object]]:
    """Our step without and with the engine's fused clipping, and the norm alone."""
    gradients = [param.grad for group in optimizer.param_groups for param in group["params"]]

    def step() -> None:
        optimizer.grad_scale = 1.0 / LOSS_SCALE
        optimizer.step()

    def clipped_step() -> None:
        norm = clipping.global_grad_norm(gradients, reduce=False)
        optimizer.grad_scale = clipping.grad_scale_for(norm, LOSS_SCALE, MAX_GRAD_NORM)
        optimizer.step()

    return {
        "lazyzero_adamw8bit": step,
        "lazyzero_adamw8bit_clipped": clipped_step,
        "lazyzero_grad_norm": lambda: clipping.global_grad_norm(gradients, reduce=False),
    }


def deepspeed_cpu_adam(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds its C++ op on first use

    return DeepSpeedCPUAdam(params, adamw_mode=True, fp32_optimizer_states=True, **HYPERPARAMETERS)


def bitsandbytes_adamw8bit(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, **HYPERPARAMETERS)


REQUIRED_CPU_BASELINES: dict[str, Factory] = {
    "deepspeed_cpu_adam": deepspeed_cpu_adam,
    "torch_adamw_foreach": lambda params: torch.optim.AdamW(params, foreach=True, **HYPERPARAMETERS),
}
OPTIONAL_CPU_BASELINES: dict[str, Factory] = {
    "torch_adamw_fused": lambda params: torch.optim.AdamW(params, fused=True, **HYPERPARAMETERS),
    "bitsandbytes_adamw8bit": bitsandbytes_adamw8bit,
}


def optional_baseline(factory: Factory, params: list[torch.nn.Parameter]) -> tuple[torch.optim.Optimizer | None, str]:
    """The optimizer after one step (which also builds any JIT op), or None and why it cannot run.

    Any exception means "not available here" (missing package, no CPU kernel, unsupported flag);
    the benchmark still measures everything else and records the reason.
    """
    try:
        optimizer = factory(params)
        optimizer.step()
    except Exception as error:
        return None, f"{type(error).__name__}: {error}".splitlines()[0]
    return optimizer, ""


def moment_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of state tensors other than 0-dim step counters (codes, scales, fp32 moments)."""
    if isinstance(optimizer, AdamW8bit):
        return optimizer.state_bytes()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor) and value.dim() > 0)


def measure_cpu(repeats: int) -> tuple[dict[str, float], dict]:
    """(headline results, details) of every CPU case; each optimizer has stepped before timing."""
    initial = random_tensors("cpu", PARAMETER_STD, seed=0)
    gradients = random_tensors("cpu", GRADIENT_STD, seed=1)
    ours = AdamW8bit(parameter_copies(initial, gradients), **HYPERPARAMETERS)
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name, factory in REQUIRED_CPU_BASELINES.items():
        optimizers[name] = factory(parameter_copies(initial, gradients))
        optimizers[name].step()  # builds DeepSpeed's op before any timing
    skipped = {}
    for name, factory in OPTIONAL_CPU_BASELINES.items():
        optimizer, reason = optional_baseline(factory, parameter_copies(initial, gradients))
        if optimizer is None:
            skipped[name] = reason
        else:
            optimizers[name] = optimizer
    del initial
    cases = {**lazyzero_cases(ours), **{name: optimizer.step for name, optimizer in optimizers.items()}}
    seconds = median_seconds(cases, repeats)
    optimizers["lazyzero_adamw8bit"] = ours
    return cpu_results(seconds, ours), cpu_details(seconds, optimizers, skipped)


def cpu_results(seconds: dict[str, float], ours: AdamW8bit) -> dict[str, float]:
    step = seconds["lazyzero_adamw8bit"]
    torch_baseline = min(seconds[name] for name in TORCH_ADAMW_VARIANTS if name in seconds)
    results = {
        "speed_ratio_vs_ds_cpu_adam": seconds["deepspeed_cpu_adam"] / step,
        "speed_ratio_vs_torch_adamw": torch_baseline / step,
        "state_bytes_per_param": ours.state_bytes() / PARAMETERS,
        "clip_overhead": seconds["lazyzero_adamw8bit_clipped"] / step,
        # Context, no target: against the foreach variant alone (torch's multi-tensor AdamW).
        "speed_ratio_vs_torch_adamw_foreach": seconds["torch_adamw_foreach"] / step,
    }
    if "bitsandbytes_adamw8bit" in seconds:
        results["speed_ratio_vs_bitsandbytes_adamw8bit"] = seconds["bitsandbytes_adamw8bit"] / step
    return results


def cpu_details(seconds: dict[str, float], optimizers: dict[str, torch.optim.Optimizer], skipped: dict) -> dict:
    torch_variants = [name for name in TORCH_ADAMW_VARIANTS if name in seconds]
    return {
        "seconds": seconds,
        "params_per_second": {name: PARAMETERS / value for name, value in seconds.items()},
        "state_bytes_per_param_by_optimizer": {name: moment_state_bytes(optimizer) / PARAMETERS
                                               for name, optimizer in optimizers.items()},
        "torch_adamw_baseline": min(torch_variants, key=seconds.get),
        "skipped": skipped,
        "setup": {"parameters": PARAMETERS, "tensors": TENSORS, **HYPERPARAMETERS,
                  "block_size": optimizers["lazyzero_adamw8bit"].param_groups[0]["block_size"],
                  "gradient_std": GRADIENT_STD, "max_grad_norm": MAX_GRAD_NORM},
    }


def engine_config(eight_bit: bool) -> dict:
    config = {"train_micro_batch_size_per_gpu": ENGINE_BATCH, "gradient_accumulation_steps": 1,
              "gradient_clipping": ENGINE_CLIP,
              "optimizer": {"type": "AdamW", "params": {"lr": HYPERPARAMETERS["lr"],
                                                        "betas": list(HYPERPARAMETERS["betas"]),
                                                        "eps": HYPERPARAMETERS["eps"],
                                                        "weight_decay": HYPERPARAMETERS["weight_decay"]}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
    if eight_bit:
        config["lazyzero"] = {"optimizer": {"enabled": True, "type": "adamw8bit"}}
    return config


def engine_step_seconds(eight_bit: bool, repeats: int) -> dict[str, float]:
    """`engine.step()` seconds with every step clipped and with clipping off: medians, and the
    median over `repeats` pairs of adjacent steps of their ratio (pairs in the order ABBA, so that
    neither case always runs first; adjacent steps see the same machine load)."""
    import lazyzero

    torch.manual_seed(0)
    width = int((PARAMETERS // TENSORS) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(TENSORS)])
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(),
                                          config=engine_config(eight_bit))
    inputs = torch.randn(ENGINE_BATCH, width, device=engine.device)  # DeepSpeed's accelerator: cuda on a GPU

    def timed_step(clip: float) -> float:
        engine.optimizer.clip_grad = clip
        engine.backward(engine(inputs).square().mean())
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    timed_step(ENGINE_CLIP), timed_step(0.0)  # warm-up: state allocation
    pairs = []
    for index in range(repeats):
        order = (ENGINE_CLIP, 0.0) if index % 2 == 0 else (0.0, ENGINE_CLIP)
        seconds = dict(zip(order, (timed_step(clip) for clip in order)))
        pairs.append((seconds[ENGINE_CLIP], seconds[0.0]))
    norm = float(engine.get_global_grad_norm())
    destroy_engine(engine)
    return {"clipped": statistics.median(c for c, _ in pairs), "unclipped": statistics.median(u for _, u in pairs),
            "pair_ratio": statistics.median(c / u for c, u in pairs), "grad_norm": norm}


def measure_engine_clipping(repeats: int) -> tuple[dict[str, float], dict]:
    """Clip overhead of a whole ZeRO-2 engine step, ours and DeepSpeed's (see the module docstring)."""
    import deepspeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    seconds = {"lazyzero_adamw8bit": engine_step_seconds(True, repeats),
               "deepspeed_adamw": engine_step_seconds(False, repeats)}
    results = {"engine_clip_overhead": seconds["lazyzero_adamw8bit"]["pair_ratio"],
               "engine_clip_overhead_deepspeed": seconds["deepspeed_adamw"]["pair_ratio"]}
    return results, {"engine_step_seconds": seconds, "engine_setup": {"zero_stage": 2, "ranks": 1,
                                                                      "batch": ENGINE_BATCH, "clip": ENGINE_CLIP}}


def measure_gpu(repeats: int) -> tuple[dict[str, float], dict]:
    """Our AdamW8bit on CUDA tensors against torch's fused AdamW there (and bitsandbytes' AdamW8bit where
    it runs), the clip overhead, and the bandwidth each step achieves against a device copy's."""
    initial = random_tensors("cuda", PARAMETER_STD, seed=0)
    gradients = random_tensors("cuda", GRADIENT_STD, seed=1)
    ours = AdamW8bit(parameter_copies(initial, gradients), **HYPERPARAMETERS)
    fused = torch.optim.AdamW(parameter_copies(initial, gradients), fused=True, **HYPERPARAMETERS)
    bnb, skipped = optional_baseline(bitsandbytes_adamw8bit, parameter_copies(initial, gradients))
    del initial
    source = torch.cat(gradients)
    destination = torch.empty_like(source)
    cases = {**lazyzero_cases(ours), "torch_adamw_fused": fused.step, "device_copy": lambda: destination.copy_(source)}
    if bnb is not None:
        cases["bitsandbytes_adamw8bit"] = bnb.step
    seconds = median_seconds(cases, repeats)
    step = seconds["lazyzero_adamw8bit"]
    copy_bytes_per_s = 2 * source.numel() * source.element_size() / seconds["device_copy"]
    fractions = {name: per_param * PARAMETERS / seconds[name] / copy_bytes_per_s
                 for name, per_param in STEP_BYTES_PER_PARAM.items() if name in seconds}
    results = {
        "gpu_speed_ratio_vs_torch_adamw_fused": seconds["torch_adamw_fused"] / step,
        "gpu_state_bytes_per_param": ours.state_bytes() / PARAMETERS,
        "gpu_clip_overhead": seconds["lazyzero_adamw8bit_clipped"] / step,
        "gpu_bandwidth_fraction": fractions["lazyzero_adamw8bit"],
    }
    if bnb is not None:
        results["gpu_speed_ratio_vs_bitsandbytes_adamw8bit"] = seconds["bitsandbytes_adamw8bit"] / step
    details = {"seconds": seconds, "params_per_second": {name: PARAMETERS / value for name, value in seconds.items()},
               "device": torch.cuda.get_device_name(), "device_copy_bytes_per_s": copy_bytes_per_s,
               "bandwidth_fraction": fractions, "step_bytes_per_param": STEP_BYTES_PER_PARAM,
               "skipped": {} if bnb is not None else {"bitsandbytes_adamw8bit": skipped}}
    return results, details


def main() -> None:
    args = parse_args()
    pin_threads(args.threads)
    if args.gpu_only:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu-only: no CUDA device here")
        native_build.ensure_native("cuda")  # raises, naming the reason, when the CUDA kernels cannot load
        results, gpu_details = measure_gpu(repeats=20 if args.quick else 100)
        write_results(args.out, "bench_optim", args.quick, results, {"gpu": gpu_details})
        return
    if not native_build.ensure_native("cpu"):
        raise SystemExit("the C++ kernels are unavailable:\n" + native_build.format_status(native_build.status()))
    results, details = measure_cpu(repeats=5 if args.quick else 21)
    engine_results, engine_details = measure_engine_clipping(repeats=24 if args.quick else 60)
    results.update(engine_results)
    details.update(engine_details)
    if torch.cuda.is_available():
        native_build.ensure_native("cuda")  # raises, naming the reason, when the CUDA kernels cannot load
        gpu_results, details["gpu"] = measure_gpu(repeats=20 if args.quick else 100)
        results.update(gpu_results)
    write_results(args.out, "bench_optim", args.quick, results, details)


if __name__ == "__main__":
    main()
