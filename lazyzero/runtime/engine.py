"""`LazyZeroEngine`: the DeepSpeedEngine subclass every lazyzero capability plugs into.

With every feature off it adds nothing to DeepSpeed's code path, so losses equal plain DeepSpeed
bit for bit (tests/runtime/test_engine_equivalence.py). Features attach through DeepSpeed's own hooks
(`_configure_zero_optimizer`, `_configure_checkpointing`, ...; see shared/docs/DEEPSPEED_NOTES.md)
as their issues land.
"""

from __future__ import annotations

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import log_dist

from lazyzero.config import LazyZeroConfig
from lazyzero.runtime.grad_exchange_hooks import install_int8_gradients


class LazyZeroEngine(DeepSpeedEngine):
    """A DeepSpeedEngine that also carries the validated `"lazyzero"` config section."""

    def __init__(self, *args, lazyzero_config: LazyZeroConfig, **kwargs):
        # Set before DeepSpeed's constructor: its configure hooks, which our overrides will
        # extend, run inside it and need to know which features are on.
        self.lazyzero_config = lazyzero_config
        super().__init__(*args, **kwargs)
        self._gradient_exchange = None
        if lazyzero_config.gradients.quantize == "int8":
            # Installed after construction: no gradient is reduced before the first backward.
            self._gradient_exchange = install_int8_gradients(self)
        features = lazyzero_config.enabled_features()
        log_dist(f"lazyzero: features on: {', '.join(features) if features else 'none'}", ranks=[0])

    def lazyzero_step_metrics(self) -> dict:
        """Per-step figures that lazyzero features add to the training log (none while all are off).

        With int8 gradients, those of the last optimizer step: `grad_wire_bytes` (bytes this rank
        sent), `grad_fp32_wire_bytes` (what an fp32 reduction of the same buckets sends),
        `grad_exchange_s` (host seconds in the exchanges) and `grad_overflow` (step skipped).
        """
        if self._gradient_exchange is None:
            return {}
        return dict(self._gradient_exchange.last_step_metrics)
