"""`LazyZeroEngine`: the DeepSpeedEngine subclass every lazyzero capability plugs into.

With every feature off it adds nothing to DeepSpeed's code path, so losses equal plain DeepSpeed
bit for bit (tests/test_engine_equivalence.py). Features attach through DeepSpeed's own hooks
(`_configure_zero_optimizer`, `_configure_checkpointing`, ...; see shared/docs/DEEPSPEED_NOTES.md)
as their issues land.
"""

from __future__ import annotations

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import log_dist

from lazyzero.config import LazyZeroConfig


class LazyZeroEngine(DeepSpeedEngine):
    """A DeepSpeedEngine that also carries the validated `"lazyzero"` config section."""

    def __init__(self, *args, lazyzero_config: LazyZeroConfig, **kwargs):
        # Set before DeepSpeed's constructor: its configure hooks, which our overrides will
        # extend, run inside it and need to know which features are on.
        self.lazyzero_config = lazyzero_config
        super().__init__(*args, **kwargs)
        features = lazyzero_config.enabled_features()
        log_dist(f"lazyzero: features on: {', '.join(features) if features else 'none'}", ranks=[0])

    def lazyzero_step_metrics(self) -> dict:
        """Per-step figures that lazyzero features add to the training log (none while all are off)."""
        return {}
