"""The "lazyzero" section of a DeepSpeed config, composed: `LazyZeroConfig` holds one model per capability,
every feature off by default, and `DistributedConfig`, which belongs to no capability. Each capability's
section lives beside it (`lazyzero/<capability>/config.py`); the base class, and why it is not
DeepSpeed's, is `lazyzero/config/section.py`.
"""

from __future__ import annotations

from pydantic import Field

from lazyzero.activations.config import ActivationsConfig
from lazyzero.checkpoint.config import CheckpointConfig
from lazyzero.config.section import ConfigSection
from lazyzero.gradients.config import GradientsConfig
from lazyzero.optimizer.config import OptimizerConfig
from lazyzero.plan.config import PlanConfig


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
