"""`LazyZeroEngine`: the DeepSpeedEngine subclass every lazyzero capability plugs into.

With every feature off it adds nothing to DeepSpeed's code path, so losses equal plain DeepSpeed
bit for bit (tests/runtime/test_engine_equivalence.py). Features attach through DeepSpeed's own hooks
(`_configure_zero_optimizer`, `_configure_checkpointing`, ...; see shared/docs/DEEPSPEED_NOTES.md)
as their issues land.
"""

from __future__ import annotations

import os

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils import logger
from deepspeed.utils.logging import print_dist

from lazyzero.config import LazyZeroConfig
from lazyzero.runtime.grad_exchange_hooks import install_int8_gradients
from lazyzero.runtime.rank_state import load_rank_state, save_rank_state


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
        print_dist(f"lazyzero: features on: {', '.join(features) if features else 'none'}", ranks=[0])

    def lazyzero_step_metrics(self) -> dict:
        """Per-step figures that lazyzero features add to the training log (none while all are off).

        With int8 gradients, those of the last optimizer step: `grad_wire_bytes` (bytes this rank
        sent), `grad_fp32_wire_bytes` (what an fp32 reduction of the same buckets sends),
        `grad_exchange_s` (host seconds in the exchanges) and `grad_overflow` (step skipped).
        """
        if self._gradient_exchange is None:
            return {}
        return dict(self._gradient_exchange.last_step_metrics)

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint, plus this rank's lazyzero state (`rank_state.py`) when a
        feature keeps any, written first so that 'latest' never names a checkpoint without it."""
        features = self._lazyzero_rank_state()
        if features:
            tag = f"global_step{self.global_steps}" if tag is None else tag
            save_rank_state(os.path.join(save_dir, str(tag)), self.global_rank, self.world_size, features)
        return super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                       exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load (same arguments, same positions), then this rank's lazyzero state when
        the optimizer state is loaded."""
        load_path, client_state = super().load_checkpoint(
            load_dir, tag=tag, load_module_strict=load_module_strict, load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
            custom_load_fn=custom_load_fn)
        if load_path is not None and load_optimizer_states and not load_module_only:
            self._restore_lazyzero_rank_state(os.path.dirname(load_path))
        return load_path, client_state

    def _keeps_rank_state(self) -> bool:
        return self._gradient_exchange is not None and self._gradient_exchange.error_feedback is not None

    def _lazyzero_rank_state(self) -> dict:
        return {"gradients": self._gradient_exchange.state_dict()} if self._keeps_rank_state() else {}

    def _restore_lazyzero_rank_state(self, tag_dir: str) -> None:
        if not self._keeps_rank_state():
            return
        features, why_not = load_rank_state(tag_dir, self.global_rank, self.world_size)
        if features is None:
            logger.warning(f"lazyzero: {why_not}; the int8 gradient error-feedback residuals restart from zero")
            return
        self._gradient_exchange.load_state_dict(features.get("gradients"))
