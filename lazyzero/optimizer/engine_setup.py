"""The 8-bit optimizer inside the engine: built where DeepSpeed builds its Adam, clipped fused.

`"lazyzero": {"optimizer": {"enabled": true, "type": "adamw8bit" | "adam8bit"}}` replaces the Adam/AdamW that
DeepSpeed's "optimizer" section would build, with its hyper-parameters (lr, betas, eps,
weight_decay). ZeRO then wraps it like any basic optimizer: it steps fp32 master partitions on the
device (stages 0-3) or on the host under optimizer offload, where DeepSpeed would run its CPU Adam.
"""

from __future__ import annotations

import math

from deepspeed.utils.logging import print_dist

from lazyzero.optimizer import Adam8bit, AdamW8bit, clipping
from lazyzero.optimizer.config import ADAM_FAMILY
from lazyzero.optimizer.state_policy import choose_state_precision, split_param_groups
from lazyzero.patch_point import extend_list, set_state

# Keys of DeepSpeed's Adam sections that pick DeepSpeed's implementation, not the mathematics.
IMPLEMENTATION_KEYS = ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach", "fused", "capturable",
                       "bias_correction", "differentiable", "maximize")
HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def check_optimizer_source(lazyzero_config, client_optimizer, config_class) -> None:
    """Before DeepSpeed builds anything: the 8-bit optimizer needs the config's Adam/AdamW section
    and no optimizer from code (DeepSpeed would silently use that one instead)."""
    if not lazyzero_config.optimizer.enabled:
        return
    if client_optimizer is not None:
        raise ValueError(
            f"lazyzero.optimizer.enabled is true, but an optimizer object ({type(client_optimizer).__name__}) "
            "came from code: the 8-bit optimizer is built from the DeepSpeed config's \"optimizer\" section "
            "(type AdamW or Adam, its params the hyper-parameters) instead. To get it: give the config that "
            "section and no optimizer from code (lazyzero.initialize / deepspeed.initialize: optimizer=None; "
            "Hugging Face Trainer: no `optimizers=` argument, it then defers to the section; Accelerate: "
            "prepare `accelerate.utils.DummyOptim(params)` instead of a torch optimizer). Or set "
            "lazyzero.optimizer.enabled to false to keep yours")
    name = getattr(config_class, "optimizer_name", None)
    if name is None or name.lower() not in ADAM_FAMILY:
        raise ValueError("lazyzero.optimizer.enabled: true needs an \"optimizer\" section of type Adam or AdamW "
                         f"in the DeepSpeed config (its hyper-parameters are used); got {name!r}")


def build_8bit_optimizer(engine, model_parameters) -> Adam8bit:
    """The basic optimizer DeepSpeed's `_configure_basic_optimizer` would return, 8-bit instead."""
    settings = engine.lazyzero_config.optimizer
    hyperparameters = _hyperparameters(engine.optimizer_params() or {})
    plan = choose_state_precision(list(engine.module.named_parameters()), settings)
    groups = split_param_groups(engine.module, model_parameters, plan)
    optimizer_class = AdamW8bit if settings.type == "adamw8bit" else Adam8bit
    _declare_zero_support(optimizer_class)
    print_dist(f"lazyzero: {optimizer_class.__name__}: {plan.summary()}", ranks=[0])
    # min_8bit_size is applied by the policy on whole parameters; ZeRO's flat partitions of an
    # 8-bit group stay 8-bit whatever their size on this rank.
    return optimizer_class(groups, block_size=settings.block_size, min_8bit_size=0, **hyperparameters)


def _declare_zero_support(optimizer_class) -> None:
    """Add our class to DeepSpeed's list of optimizers ZeRO is tested with (else it demands
    zero_allow_untested_optimizer): tests/optimizer/test_engine_8bit.py runs it on every stage."""
    from deepspeed.runtime.zero import utils

    extend_list(utils, "ZERO_SUPPORTED_OPTIMIZERS", optimizer_class, owner="lazyzero.optimizer (8-bit Adam)")


def _hyperparameters(params: dict) -> dict:
    if params.get("amsgrad"):
        raise ValueError("optimizer.params.amsgrad: got true; the 8-bit optimizers implement Adam/AdamW without "
                         "amsgrad (allowed: false or absent)")
    unknown = set(params) - set(HYPERPARAMETERS) - set(IMPLEMENTATION_KEYS) - {"amsgrad"}
    if unknown:
        raise ValueError(f"optimizer.params: {sorted(unknown)} not understood by lazyzero's 8-bit optimizers "
                         f"(allowed: {', '.join(HYPERPARAMETERS + IMPLEMENTATION_KEYS)})")
    chosen = {key: params[key] for key in HYPERPARAMETERS if key in params}
    if "betas" in chosen:
        chosen["betas"] = tuple(chosen["betas"])
    return chosen


def install_fused_clipping(engine, zero_optimizer) -> None:
    """Route the ZeRO optimizer's norm and clip through the fused versions (lazyzero.optimizer.clipping)."""
    if engine.zero_optimization_stage() == 3:
        clipping.install_on_stage_3(zero_optimizer)
    else:
        clipping.install_on_stage_1_2(zero_optimizer)


def stage_0_norm_and_clip(engine) -> None:
    """Stage 0, fp32: gradients are all-reduced already, so the norm needs no reduction. It is
    computed every step (reported, and a non-finite one skips the step), clipped when configured."""
    optimizer = engine.optimizer
    gradients = [param.grad for param in engine.module.parameters() if param.grad is not None]
    norm = clipping.global_grad_norm(gradients, reduce=False)
    optimizer.grad_scale = clipping.grad_scale_for(norm, 1.0, engine.gradient_clipping())
    # The engine reads the norm from its optimizer after the step and reports it.
    set_state(optimizer, "_global_grad_norm", float(norm), owner="lazyzero.optimizer (fused clipping)",
              holder="deepspeed.runtime.engine:DeepSpeedEngine")
    # DeepSpeed reads `overflow` after the step: it then counts a skipped step and holds the LR.
    optimizer.overflow = not math.isfinite(optimizer.grad_scale)
