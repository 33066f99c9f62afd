"""Train the tiny model with fp32 and with int8 gradients per ZeRO setting, then inject a NaN on one
rank; write what each rank saw to OUT/rank{r}.json (tests/gradients/test_int8_gradients.py).

Usage (under a launcher): int8_gradients_worker.py OUT SETTING [SETTING ...]
SETTING is a stage "0".."3", optionally with variants, each after a "+": "allreduce" (stage 1/2
with reduce_scatter false: DeepSpeed all-reduces the bucket), "contiguous" (stage 3 with
reduce_scatter false: DeepSpeed's `__avg_scatter_contiguous_grads`), "predivide"
(gradient_predivide_factor 4), "stochastic" (stochastic rounding, seed 5, block size 128),
"bf16" (bf16 model; with fp32 gradient accumulation from stage 1 on), "cpu" (optimizer state
offloaded to the CPU; parameters too at stage 3), "ef" (error feedback).

DeepSpeed's full-precision reduction methods and torch.distributed's reductions are wrapped before
anything starts, so each run reports how often the former ran and the largest floating-point
tensor the latter reduced.
"""

import functools
import json
from collections import Counter
from pathlib import Path

import deepspeed
import torch
import torch.distributed as torch_dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils import safe_get_full_grad

import lazyzero
from lazyzero.models import build_model
from lazyzero.testing import destroy_engine, worker_args

STEPS = 5
NAN_STEP = 2
FULL_PRECISION_METHODS = [
    (DeepSpeedZeroOptimizer_Stage3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"),
    (DeepSpeedZeroOptimizer_Stage3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads"),
    (DeepSpeedZeroOptimizer, "average_tensor"),
    (DeepSpeedEngine, "allreduce_bucket"),
]
REDUCTIONS = ["all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"]
calls = Counter()
largest_reduced = Counter()
measuring = {"on": True}


def counted(name, function):
    # functools.wraps: the engine checks DeepSpeed's method signatures at start (patch_point.py),
    # and a counting wrapper must show the original's.
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)

    return wrapper


def measured(name, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if measuring["on"]:
            for a in [*args, *kwargs.values()]:
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    largest_reduced[name] = max(largest_reduced[name], a.numel())
        return function(*args, **kwargs)

    return wrapper


def wrap_reductions() -> None:
    for cls, name in FULL_PRECISION_METHODS:
        setattr(cls, name, counted(name, getattr(cls, name)))
    for name in REDUCTIONS:
        setattr(torch_dist, name, measured(name, getattr(torch_dist, name)))


def ds_config(setting: str, int8: bool) -> dict:
    stage, *variants = setting.split("+")
    zero = {"stage": int(stage), "reduce_bucket_size": 200_000, "stage3_param_persistence_threshold": 0}
    gradients = {"enabled": int8}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "lazyzero": {"gradients": gradients},
    }
    if "allreduce" in variants or "contiguous" in variants:
        zero["reduce_scatter"] = False
    if "predivide" in variants:
        config["gradient_predivide_factor"] = 4.0
    if "bf16" in variants:
        config["bf16"] = {"enabled": True}
        if zero["stage"] > 0:  # DeepSpeed refuses fp32 accumulation of a bf16 model at stage 0
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    if "cpu" in variants:  # DeepSpeed's CPU Adam on offloaded optimizer state, as users get
        config["optimizer"]["params"]["torch_adam"] = False
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    if "ef" in variants and int8:
        gradients["error_feedback"] = True
    if "stochastic" in variants:
        gradients.update(stochastic_rounding=True, seed=5, block_size=128)
    return config


def parameter_copies(engine, stage: int) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    if stage != 3:
        return [p.detach().clone() for p in params]
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def averaged_gradient(engine) -> torch.Tensor:
    """The whole reduced gradient, as the optimizer is about to see it (before clipping).

    Gathering it reduces full-size tensors at stages 1/2; those reductions are the test's, not
    training's, so they are not measured."""
    measuring["on"] = False
    gradient = torch.cat([full_gradient(p).reshape(-1).float() for p in engine.module.parameters()])
    measuring["on"] = True
    return gradient


def full_gradient(param) -> torch.Tensor:
    """DeepSpeed's BF16_Optimizer keeps every parameter's reduced fp32 gradient on every rank in
    `_hp_grad`, which DeepSpeed 0.19.8's safe_get_full_grad reads; 0.19.7's returns the parameter's
    unreduced bf16 `grad` instead."""
    hp_grad = getattr(param, "_hp_grad", None)
    return hp_grad if hp_grad is not None else safe_get_full_grad(param)


def residual_norm(engine) -> float | None:
    """Norm of all of this rank's error-feedback residuals (None without error feedback)."""
    exchange = engine.lazyzero_features.section("gradients").exchange
    if exchange is None or exchange.error_feedback is None:
        return None
    residuals = exchange.state_dict()["residuals"]
    return float(torch.cat(residuals).norm()) if residuals else 0.0


def run(setting: str, int8: bool, nan_step: int | None) -> dict:
    calls.clear()
    largest_reduced.clear()
    stage = int(setting[0])
    model = build_model("tiny", seed=7, vocab_size=300)
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(setting, int8))
    generator = torch.Generator().manual_seed(100 + engine.global_rank)
    losses, metrics, unchanged, finite, residual_norms = [], [], [], [], []
    for step in range(STEPS):
        before = parameter_copies(engine, stage) if nan_step is not None else None
        for micro in range(engine.gradient_accumulation_steps()):
            ids = torch.randint(0, 300, (2, 16), generator=generator)
            loss = engine(input_ids=ids, labels=ids).loss
            losses.append(loss.item())
            if step == nan_step and micro == 1 and engine.global_rank == 1:
                loss = loss * float("nan")
            engine.backward(loss)
            if step == 0 and engine.is_gradient_accumulation_boundary():
                first_gradient = averaged_gradient(engine)
            engine.step()
        metrics.append(engine.lazyzero_step_metrics())
        residual_norms.append(residual_norm(engine))
        if before is not None:
            after = parameter_copies(engine, stage)
            unchanged.append(all(torch.equal(a, b) for a, b in zip(before, after)))
            finite.append(all(bool(torch.isfinite(a).all()) for a in after))
    result = {"first_gradient": first_gradient, "losses": losses, "metrics": metrics, "calls": dict(calls),
              "largest_reduced": dict(largest_reduced), "unchanged": unchanged, "finite": finite,
              "skipped_steps": engine.skipped_steps, "residual_norms": residual_norms}
    destroy_engine(engine)
    return result


def refusal_without_contiguous_gradients() -> str:
    """The error of int8 gradients at stage 2 without a contiguous bucket (DeepSpeed would reduce
    through a full-precision path the hooks do not replace)."""
    config = ds_config("2", True)
    config["zero_optimization"]["contiguous_gradients"] = False
    model = build_model("tiny", seed=7, vocab_size=300)
    try:
        lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as error:
        return str(error)
    return "accepted"


def main() -> None:
    wrap_reductions()
    args = worker_args()
    out, settings = Path(args[0]), args[1:]
    result = {}
    for setting in settings:
        runs = {"fp32": run(setting, False, None), "int8": run(setting, True, None),
                "nan": run(setting, True, NAN_STEP)}
        exact = runs["fp32"]["first_gradient"]
        error = (runs["int8"]["first_gradient"] - exact).norm() / exact.norm()
        for name in runs:
            del runs[name]["first_gradient"]
        result[setting] = {**runs, "first_gradient_relative_error": error.item()}
    result["refusal_without_contiguous_gradients"] = refusal_without_contiguous_gradients()
    (out / f"rank{torch_dist.get_rank()}.json").write_text(json.dumps(result))
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
