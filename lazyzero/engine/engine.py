"""`LazyZeroEngine`: the DeepSpeedEngine subclass every lazyzero capability plugs into.

Each override below is one of DeepSpeed's own methods (docs/deepspeed-internals.md) and calls the
hook of the same moment on every feature (lazyzero/engine/features.py); the engine names no
capability. With every feature off each hook is a no-op, so losses equal plain DeepSpeed bit for
bit (tests/engine/test_engine_equivalence.py).
"""

from __future__ import annotations

import weakref

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils.logging import print_dist

from lazyzero.config import LazyZeroConfig
from lazyzero.engine.features import FeatureSet
from lazyzero.engine.monitor_metrics import write_step_metrics
from lazyzero.feature import Feature, LoadRequest

_ZERO_OPTIMIZERS = (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)
# Engines of this process, oldest first, for code that the trainers call without the engine
# (trainer_logs.py): weak, so that a destroyed engine is not kept alive.
_LIVE_ENGINES: list[weakref.ref] = []


def newest_engine() -> LazyZeroEngine | None:
    """The most recently built LazyZeroEngine of this process that still exists."""
    _LIVE_ENGINES[:] = [ref for ref in _LIVE_ENGINES if ref() is not None]
    return _LIVE_ENGINES[-1]() if _LIVE_ENGINES else None


class LazyZeroEngine(DeepSpeedEngine):
    """A DeepSpeedEngine that also carries the validated `"lazyzero"` config section and its features."""

    def __init__(self, *args, lazyzero_config: LazyZeroConfig, features: FeatureSet | None = None, **kwargs):
        # Set before DeepSpeed's constructor: its configure hooks, which our overrides extend, run
        # inside it and call the features.
        self.lazyzero_config = lazyzero_config
        self.lazyzero_features = features if features is not None else FeatureSet(lazyzero_config)
        self._lazyzero_metrics_of_step: tuple[int | None, dict] = (None, {})
        self.lazyzero_features.call(Feature.check_engine_arguments, kwargs.get("optimizer"), kwargs.get("config_class"))
        super().__init__(*args, **kwargs)
        self.lazyzero_features.call(Feature.attach, self)
        _LIVE_ENGINES.append(weakref.ref(self))
        on = lazyzero_config.enabled_features()
        print_dist(f"lazyzero: features on: {', '.join(on) if on else 'none'}", ranks=[0])

    # --- what features report ---------------------------------------------------------------------

    def lazyzero_step_metrics(self) -> dict:
        """Per-step figures that lazyzero features add to the training log (none while all are off);
        each feature's `step_metrics` documents its keys. Taken once per optimizer step (some features
        count since their last call): on the first call after the step, or right after it when the
        config enables a DeepSpeed monitor, which then receives them (monitor_metrics.py)."""
        taken_at, metrics = self._lazyzero_metrics_of_step
        if taken_at != self.global_steps:
            metrics = self.lazyzero_features.merged(Feature.step_metrics, self)
            self._lazyzero_metrics_of_step = (self.global_steps, metrics)
        return metrics

    def lazyzero_report(self) -> dict:
        """What lazyzero features add to the run report (e.g. saved-activation bytes per layer, the
        plan and every comparison of measured with predicted)."""
        return self.lazyzero_features.merged(Feature.report, self)

    def lazyzero_rank_state(self) -> dict:
        """Per-rank state of lazyzero features, saved in lazyzero_rank<R>.pt."""
        return self.lazyzero_features.merged(Feature.rank_state, self)

    def lazyzero_reconfigure(self, section: str, settings: dict | None) -> None:
        """A new plan's settings for `section` (a "lazyzero" sub-section; None: off), between steps."""
        self.lazyzero_features.call(Feature.reconfigure, self, section, settings)

    # --- building ---------------------------------------------------------------------------------

    def _configure_basic_optimizer(self, model_parameters):
        built = self.lazyzero_features.first(Feature.build_basic_optimizer, self, model_parameters)
        return built if built is not None else super()._configure_basic_optimizer(model_parameters)

    def _configure_zero_optimizer(self, optimizer):
        with self.lazyzero_features.around(Feature.around_zero_optimizer_build, self):
            zero_optimizer = super()._configure_zero_optimizer(optimizer)
        self.lazyzero_features.call(Feature.after_zero_optimizer_build, self, zero_optimizer)
        return zero_optimizer

    def _configure_checkpointing(self):
        super()._configure_checkpointing()
        replacement = self.lazyzero_features.first(Feature.checkpoint_engine, self)
        if replacement is not None:
            self.checkpoint_engine = replacement

    # --- training ---------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        with self.lazyzero_features.around(Feature.around_forward, self):
            return super().forward(*inputs, **kwargs)

    def clip_fp32_gradients(self):
        if not self.lazyzero_features.any(Feature.replaces_clip_pass, self):
            super().clip_fp32_gradients()

    def _take_model_step(self, lr_kwargs, *block_eigenvalue):
        # DeepSpeed 0.19.7 also passes block_eigenvalue when its eigenvalue option is on; 0.19.8 has neither.
        if self.lazyzero_config.enabled_features() and isinstance(self.optimizer, _ZERO_OPTIMIZERS):
            # A skip lazyzero decided (int8 overflow, non-finite fused norm) ends with its step: 0.19.8's
            # ZeRO optimizers clear `overflow` when their step starts, 0.19.7's only when they check fp16 overflow.
            self.optimizer.overflow = False
        self.lazyzero_features.call(Feature.before_model_step, self)
        return super()._take_model_step(lr_kwargs, *block_eigenvalue)

    def step(self, lr_kwargs=None):
        steps_before = self.global_steps
        result = super().step(lr_kwargs)
        if self.global_steps != steps_before:
            self.lazyzero_features.call(Feature.after_optimizer_step, self)
            if self.monitor.enabled and self.lazyzero_config.enabled_features():
                write_step_metrics(self, self.lazyzero_step_metrics())
        return result

    # --- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's save (same arguments), plus this rank's lazyzero state. With lazy checkpoints it
        returns once the snapshot is queued; the files are committed in the background."""
        features = self.lazyzero_features
        if tag is not None:
            features.call(Feature.check_save_tag, self, tag)
        deepspeed_writes_latest = save_latest and not features.any(Feature.writes_latest_itself, self)
        with features.around(Feature.around_save, self, save_dir, save_latest):
            return super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                           save_latest=deepspeed_writes_latest,
                                           exclude_frozen_parameters=exclude_frozen_parameters)

    def _save_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):  # noqa: B006 - DeepSpeed's signature
        super()._save_checkpoint(save_dir, tag, client_state=client_state,
                                 exclude_frozen_parameters=exclude_frozen_parameters)
        self.lazyzero_features.call(Feature.after_deepspeed_saved, self, save_dir, tag)

    def _save_zero_checkpoint(self, save_path, tag):
        super()._save_zero_checkpoint(save_path, tag)
        self.lazyzero_features.call(Feature.after_zero_checkpoint_saved, self, save_path, tag)

    def zero_nvme_offload_optimizer(self):
        if self.lazyzero_features.any(Feature.hides_optimizer_swap_folder, self):
            return False
        return super().zero_nvme_offload_optimizer()

    def wait_for_checkpoints(self) -> None:
        """Block until every queued lazy checkpoint is committed; raise if one failed (no-op otherwise)."""
        self.lazyzero_features.call(Feature.wait, self)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load (same arguments, same positions). A lazyzero checkpoint is verified against
        its manifest first, 'latest' falls back to the newest committed checkpoint, and this rank's
        lazyzero state is restored with the optimizer state."""
        features = self.lazyzero_features
        features.call(Feature.before_load, self)
        tag = features.first(Feature.resolve_load_tag, self, load_dir, tag)
        if tag is None:
            return None, None
        request = LoadRequest(load_dir, tag, load_optimizer_states, load_module_only)
        self._lazyzero_load = request
        features.call(Feature.plan_load, self, request)
        try:
            request.load_path, client_state = super().load_checkpoint(
                load_dir, tag=tag, load_module_strict=load_module_strict,
                load_optimizer_states=request.deepspeed_loads_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                custom_load_fn=custom_load_fn)
        finally:
            features.call(Feature.end_load, self, request)
            self._lazyzero_load = None
        features.call(Feature.after_load, self, request)
        return request.load_path, client_state

    def _get_all_ckpt_names(self, checkpoints_path, tag):
        names = super()._get_all_ckpt_names(checkpoints_path, tag)
        request = getattr(self, "_lazyzero_load", None)
        if not names and request is not None:
            return (self.lazyzero_features.first(Feature.checkpoint_names_when_missing, self, request, checkpoints_path)
                    or names)
        return names

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        request = getattr(self, "_lazyzero_load", None)
        if request is not None and self.lazyzero_features.any(Feature.load_zero_checkpoint, self, request):
            return True
        return super()._load_zero_checkpoint(load_dir, tag, load_optimizer_states=load_optimizer_states)

    def destroy(self):
        if getattr(self, "lazyzero_features", None) is not None:
            self.lazyzero_features.call(Feature.close, self)
        super().destroy()
