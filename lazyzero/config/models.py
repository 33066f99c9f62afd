"""The "lazyzero" section of a DeepSpeed config, composed: `LazyZeroConfig` holds one model per capability,
every feature off by default. The sections of capabilities that own theirs live beside them
(`lazyzero/<capability>/config.py`; so far all but the planner's); the base class, and why it is not
DeepSpeed's, is `lazyzero/config/section.py`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from lazyzero.activations.config import ActivationsConfig
from lazyzero.checkpoint.config import CheckpointConfig
from lazyzero.config.fieldtypes import MemorySize, NonEmptyStr
from lazyzero.config.section import ConfigSection
from lazyzero.gradients.config import GradientsConfig
from lazyzero.optimizer.config import OptimizerConfig


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


class DistributedConfig(ConfigSection):
    """How long a rank waits for the others: the job's collectives, with or without any capability on."""

    timeout_s: float = Field(300.0, ge=1)
    """Seconds any collective (training, the lazy checkpoints' agreement) may wait for the other ranks before it
    raises and this rank exits non-zero: a rank that died or was stopped (SIGSTOP) ends the job after this long
    instead of DeepSpeed's 30 minutes (docs/reliability.md, guarantee 5). Set it above the longest time one rank can
    keep the others waiting in a collective (a native op build on first use, a non-lazy save of a large model)."""


# The capabilities, each switched by its section's `enabled`, in the order they are reported.
FEATURES = ("plan", "activations", "gradients", "optimizer", "checkpoint")


class LazyZeroConfig(ConfigSection):
    """The validated "lazyzero" section, as the engine receives it.

    Build it with `validate_ds_config`, which also applies the checks against
    the DeepSpeed settings around the section; constructing it directly checks the schema only.
    """

    plan: PlanConfig = Field(default_factory=PlanConfig)
    """Memory planner."""

    activations: ActivationsConfig = Field(default_factory=ActivationsConfig)
    """Activation quantization."""

    gradients: GradientsConfig = Field(default_factory=GradientsConfig)
    """Quantized gradient communication."""

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """8-bit optimizer."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Lazy checkpoints."""

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """The ranks' collectives."""

    def enabled_features(self) -> list[str]:
        """Names of the capabilities switched on, in the order of `FEATURES` (empty: plain DeepSpeed)."""
        return [section for section in FEATURES if getattr(self, section).enabled]
