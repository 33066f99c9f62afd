"""Checks of `"lazyzero": {"plan": {"enabled": true}}` against the rest of the config.

With the planner on, the plan decides what a user would otherwise set by hand: the width, recompute
and offload of each layer's saved activations, the 8-bit optimizer share, and DeepSpeed's parameter
and optimizer offload. A value given for one of those would be overwritten, so it is rejected, naming
the key, rather than silently replaced. Settings the plan does not choose (quantization block sizes,
rounding, norm and attention widths, int8 gradients, checkpoints) stay the user's.
"""

from __future__ import annotations

from lazyzero.config.errors import Problem
from lazyzero.config.models import LazyZeroConfig

PLANNED_OFFLOAD_SECTIONS = ("offload_param", "offload_optimizer")
_WHY_PLANNED = "the planner sets it when lazyzero.plan.enabled is true; remove it, or switch the planner off"


def plan_problems(config: LazyZeroConfig, ds_config: dict) -> list[Problem]:
    """Problems of an enabled plan; none when the planner is off."""
    if not config.plan.enabled:
        return []
    problems = []
    if config.plan.seq_len is None:
        problems.append(Problem.missing("lazyzero.plan.seq_len",
                                        "an integer >= 1 (the sequence length to plan for) "
                                        "when lazyzero.plan.enabled is true"))
    if config.plan.headroom_share is not None and config.plan.gpu_mem is not None:
        problems.append(Problem.conflict(
            "lazyzero.plan.gpu_mem", config.plan.gpu_mem, "null while lazyzero.plan.headroom_share is set",
            "headroom_share sets the compute-memory budget (the GPU's on CUDA) from the run's own profile"))
    if config.plan.checkpoint_every is not None and not config.checkpoint.enabled:
        problems.append(Problem.conflict(
            "lazyzero.plan.checkpoint_every", config.plan.checkpoint_every,
            "null unless lazyzero.checkpoint.enabled is true",
            "only lazy checkpoints copy their snapshot while training runs; DeepSpeed's own save stops training"))
    # Each section names the fields the plan sets (`ConfigSection.planned_fields`).
    for section in type(config).model_fields:
        settings = getattr(config, section)
        problems += [Problem.conflict(f"lazyzero.{section}.{name}", getattr(settings, name), "absent", _WHY_PLANNED)
                     for name in settings.planned_fields if name in settings.model_fields_set]
    return problems + _deepspeed_problems(ds_config)


def _deepspeed_problems(ds_config: dict) -> list[Problem]:
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    problems = []
    stage = zero.get("stage", 0)
    if stage != 3:
        problems.append(Problem.conflict(
            "zero_optimization.stage", stage, "3 while lazyzero.plan.enabled is true",
            "the planner places each layer's partitioned parameters, gradients and optimizer state, which only "
            "ZeRO stage 3 partitions"))
    for name in PLANNED_OFFLOAD_SECTIONS:
        section = zero.get(name)
        if isinstance(section, dict) and section.get("device", "none") != "none":
            problems.append(Problem.conflict(f"zero_optimization.{name}.device", section["device"],
                                             "'none' (or no section)", _WHY_PLANNED))
    accumulation = ds_config.get("gradient_accumulation_steps", 1)
    if accumulation != 1:
        problems.append(Problem.conflict(
            "gradient_accumulation_steps", accumulation, "1 while lazyzero.plan.enabled is true",
            "the planner models one forward and backward per optimizer step; use a larger micro-batch instead"))
    return problems
