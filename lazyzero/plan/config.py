"""The `lazyzero.plan` config section and its checks against the rest of the config.

With the planner on, the plan decides what a user would otherwise set by hand: the width, recompute
and offload of each layer's saved activations, the 8-bit optimizer share, and DeepSpeed's parameter
and optimizer offload. A value given for one of those would be overwritten, so it is rejected, naming
the key, rather than silently replaced. Settings the plan does not choose (quantization block sizes,
rounding, norm and attention widths, int8 gradients, checkpoints) stay the user's.

A capability's section module is on the foundation layer (docs/architecture.md, "The layering rule"):
it imports only `lazyzero.config` helpers, so that `lazyzero.config` composes it into `LazyZeroConfig`
and validating a config imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from lazyzero.config.errors import Problem
from lazyzero.config.fieldtypes import MemorySize, NonEmptyStr
from lazyzero.config.section import ConfigSection
from lazyzero.config.trainer_values import AUTO


class PlanConfig(ConfigSection):
    """MILP memory planner: where each tensor lives (GPU, CPU, NVMe) and at what precision."""

    enabled: bool = False
    """Let the planner choose placement and precision per layer within the budgets below (needs ZeRO stage 3 and
    `seq_len`)."""

    seq_len: Optional[int] = Field(None, ge=1)
    """Tokens per training sequence: the planner profiles and plans micro-batches of this shape. Required with
    `enabled`."""

    gpu_mem: Optional[MemorySize] = None
    """GPU memory budget per rank. null: the device's total memory. Not allowed on a machine without CUDA."""

    cpu_mem: Optional[MemorySize] = None
    """CPU memory budget per node, shared by its ranks (on a machine without a GPU, the memory training computes
    in). null: the machine's total memory."""

    headroom_share: Optional[float] = Field(None, ge=0, le=1)
    """Compute-memory budget measured on this machine instead of given in bytes: this share of the way from the
    least budget that admits a plan (0) to what the plan with every tensor in memory needs (1), both from the run's
    own profile, so that one config holds wherever it runs (another torch build or library version moves both). It
    takes the place of `cpu_mem` on a machine without a GPU and of `gpu_mem` on CUDA, which must then be null. null:
    the byte budgets decide."""

    nvme_path: Optional[NonEmptyStr] = None
    """Existing, writable folder the planner may spill tensors to. null: no NVMe tier."""

    memory_reserve: float = Field(0.1, ge=0, lt=1)
    """Share of the compute-memory budget left unplanned, for what the planner's memory model does not see (library
    buffers, allocator slack): the predicted peak stays under (1 - memory_reserve) x the budget."""

    allowed_bits: list[Literal[4, 8, 16]] = Field(default_factory=lambda: [16, 8, 4], min_length=1)
    """Widths the planner may store saved activations at (16 keeps them as saved)."""

    max_grad_error: float = Field(0.02, gt=0)
    """Most gradient error a layer's activation width may cost: the profile measures, for each layer of the run's own
    model, the relative L2 error of its parameter and input gradients with its activations stored at 8 and at 4 bits,
    and the planner does not give a layer a width whose error exceeds this (16 bits and recompute are exact and always
    allowed). 0.02 keeps 8 bits (at most 0.007 per layer on SmolLM2-135M and the demo preset) and excludes 4 bits (at
    least 0.036 there; the whole model's error at 4 bits, 0.07-0.13, misses the 0.03 target): docs/plan.md."""

    allow_recompute: bool = True
    """Let the planner recompute whole layers in backward instead of storing their activations."""

    allow_8bit_optimizer: bool = True
    """Let the planner give layers 8-bit Adam states (lazyzero's AdamW8bit/Adam8bit) instead of fp32."""

    price_int8_gradients: bool = False
    """Keep `lazyzero.gradients` (the int8 exchange) only where this machine's profile measured it, with error
    feedback where that is on, faster per byte than DeepSpeed's own reduce-scatter in the training dtype; elsewhere
    the plan switches the section off, where it would cost time and memory and save none (docs/plan.md). Needs
    `lazyzero.gradients.enabled`. false: the gradients section is used as written."""

    time_limit_s: float = Field(10.0, gt=0)
    """Wall-clock limit of the MILP solver in seconds; the best plan found by then is used."""

    max_gap: float = Field(0.01, ge=0, le=1)
    """Relative optimality gap at which the solver stops (0.01: within 1% of the optimum)."""

    profile_path: Optional[NonEmptyStr] = None
    """Profile file (`lazyzero profile`): reused when model, run shape and machine match, else measured at start and
    written there. null: measured at start, kept in ~/.cache/lazyzero/profiles."""

    plan_path: Optional[NonEmptyStr] = None
    """A plan.json (from `lazyzero plan --profile`, or a planned run's `output_dir`) to apply instead of solving at
    start; it must fit this model and these budgets. null: solve."""

    output_dir: Optional[NonEmptyStr] = None
    """Folder where rank 0 writes plan.json, the DeepSpeed config the plan implies and memory.png at start. null:
    not written (the plan is printed)."""

    measure_steps: int = Field(3, ge=1)
    """Optimizer steps, after the first, over which measured step time and peak memory are compared with the
    prediction."""

    replan: bool = True
    """Plan again, with the measurements, when they differ from the prediction by more than `replan_margin` in two
    checks in a row and in the median over the plan's checks, which the new plan is calibrated with (activation
    choices only: placements are fixed once DeepSpeed is built)."""

    replan_margin: float = Field(0.15, gt=0)
    """Relative difference between measured and predicted step time or peak memory that triggers a new plan."""

    checkpoint_every: Optional[int] = Field(None, ge=1)
    """Optimizer steps between the run's lazy checkpoints: the planner spreads each snapshot's copy traffic over the
    compute windows of that many steps, beside the other transfers. null: none planned
    (`lazyzero train --save-every N` sets it)."""


PLANNED_OFFLOAD_SECTIONS = ("offload_param", "offload_optimizer")
_WHY_PLANNED = "the planner sets it when lazyzero.plan.enabled is true; remove it, or switch the planner off"


def plan_problems(config: ConfigSection, ds_config: dict) -> list[Problem]:
    """Problems of an enabled plan; none when the planner is off. `config` is the whole section, a
    `LazyZeroConfig` (which composes `PlanConfig`, so it is not imported here): the plan also sets
    fields of the other sections, and lazy checkpoints must be on for `checkpoint_every`."""
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
    if config.plan.price_int8_gradients and not config.gradients.enabled:
        problems.append(Problem.conflict(
            "lazyzero.plan.price_int8_gradients", True, "false unless lazyzero.gradients.enabled is true",
            "the plan can only keep or switch off an int8 exchange the config turns on"))
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
    # "auto" is the trainer's to fill in (config/trainer_values.py); the built engine's value is checked
    # again when the plan is applied (deepspeed/engine_setup.py).
    if accumulation not in (1, AUTO):
        problems.append(Problem.conflict(
            "gradient_accumulation_steps", accumulation, "1 while lazyzero.plan.enabled is true",
            "the planner models one forward and backward per optimizer step; use a larger micro-batch instead"))
    return problems
