"""`LazyZeroEngine`: the DeepSpeedEngine subclass every lazyzero capability plugs into.

With every feature off it adds nothing to DeepSpeed's code path, so losses equal plain DeepSpeed
bit for bit (tests/engine/test_engine_equivalence.py). Features attach through DeepSpeed's own hooks
(`_configure_zero_optimizer`, `_configure_checkpointing`, ...; see shared/docs/DEEPSPEED_NOTES.md)
as their issues land.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext

from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.utils.logging import print_dist

from lazyzero.config import ActivationsConfig, LazyZeroConfig
from lazyzero.config.plan_checks import PLANNED_FIELDS
from lazyzero.checkpoint import engine_hooks as checkpointing
from lazyzero.optimizer import engine_setup as optimizer_setup
from lazyzero.optimizer import reshard as optimizer_reshard
from lazyzero.optimizer import zero3_reshard
from lazyzero.activations.engine_setup import ActivationMemory
from lazyzero.gradients.zero_hooks import install_int8_gradients
from lazyzero.optimizer.nvme_swap import eight_bit_state_swapping
from lazyzero.checkpoint.nvme_restore import replay_cpu_adam_after_load, restore_nvme_offloaded_state
from lazyzero.plan.monitor import PlanMonitor
from lazyzero.plan.engine_setup import planned_zero_placement


class LazyZeroEngine(DeepSpeedEngine):
    """A DeepSpeedEngine that also carries the validated `"lazyzero"` config section."""

    def __init__(self, *args, lazyzero_config: LazyZeroConfig, active_plan=None, **kwargs):
        # Set before DeepSpeed's constructor: its configure hooks, which our overrides will
        # extend, run inside it and need to know which features are on.
        self.lazyzero_config = lazyzero_config
        self.active_plan = active_plan
        self._resharding_zero3 = False  # set only inside load_checkpoint
        optimizer_setup.check_optimizer_source(lazyzero_config, kwargs.get("optimizer"), kwargs.get("config_class"))
        super().__init__(*args, **kwargs)
        self._gradient_exchange = None
        self._activation_memory = None
        if lazyzero_config.activations.enabled:
            self._activation_memory = ActivationMemory(self.module, lazyzero_config.activations,
                                                       aio_config=self._config.aio_config)
        if lazyzero_config.gradients.quantize == "int8":
            # Installed after construction: no gradient is reduced before the first backward.
            self._gradient_exchange = install_int8_gradients(self)
        self._plan_monitor = PlanMonitor(active_plan) if active_plan is not None else None
        features = lazyzero_config.enabled_features()
        print_dist(f"lazyzero: features on: {', '.join(features) if features else 'none'}", ranks=[0])

    def lazyzero_step_metrics(self) -> dict:
        """Per-step figures that lazyzero features add to the training log (none while all are off).

        With int8 gradients, those of the last optimizer step: `grad_wire_bytes` (bytes this rank
        sent), `grad_fp32_wire_bytes` (what an fp32 reduction of the same buckets sends),
        `grad_exchange_s` (host seconds in the exchanges) and `grad_overflow` (step skipped).
        With lazy checkpoints, this rank's figures of the newest committed checkpoint:
        `checkpoint_tag`, `checkpoint_bytes` (`checkpoint_direct_bytes` of them serialized straight
        from training's memory), `checkpoint_copy_s` (from `save_checkpoint` returning to the
        snapshot taken), `checkpoint_step_wait_s` (what optimizer steps waited for it),
        `checkpoint_write_s` (to this rank's files durable) and `checkpoint_commit_s` (to the commit).
        With activation quantization, `activation_saved_bytes` and `activation_packed_bytes`: this
        rank's saved activations over the step's forward passes, unpacked and as stored.
        With the 8-bit optimizer, `optimizer_state_bytes`: this rank's moment state held in memory
        (codes, scales and the fp32 moments of the groups that keep them; sub-groups swapped out to
        NVMe at that moment are not counted).
        """
        metrics = {}
        if self._plan_monitor is not None:
            metrics.update(self._plan_monitor.step_metrics())
        if self._activation_memory is not None:
            metrics.update(self._activation_memory.step_metrics())
        if self.uses_8bit_optimizer:
            metrics["optimizer_state_bytes"] = self.basic_optimizer.state_bytes()
        if self._gradient_exchange is not None:
            metrics.update(self._gradient_exchange.last_step_metrics)
        if self.lazy_checkpoints and self.checkpoint_engine.last_commit is not None:
            commit = self.checkpoint_engine.last_commit
            metrics.update(checkpoint_tag=commit["tag"], checkpoint_bytes=commit["bytes"],
                           checkpoint_direct_bytes=commit["direct_bytes"], checkpoint_step_wait_s=commit["step_wait_s"],
                           checkpoint_copy_s=commit["copy_s"], checkpoint_write_s=commit["write_s"],
                           checkpoint_commit_s=commit["queued_to_committed_s"])
        return metrics

    def lazyzero_report(self) -> dict:
        """What lazyzero features add to the run report: saved-activation bytes per layer (last step),
        and with the planner the plan and every comparison of measured with predicted."""
        report = self._activation_memory.report() if self._activation_memory is not None else {}
        if self._plan_monitor is not None:
            report.update(self._plan_monitor.report(), plan=json.loads(self.active_plan.plan.to_json()))
        if hasattr(self.optimizer, "tier_report"):
            report["zero_placement"] = self.optimizer.tier_report()
        return report

    # --- the memory planner (lazyzero/plan/engine_setup.py, plan_monitor.py) ----------------------

    def step(self, lr_kwargs=None):
        steps_before = self.global_steps
        result = super().step(lr_kwargs)
        if self._plan_monitor is not None and self.global_steps != steps_before:
            self._plan_monitor.after_optimizer_step(self)
        return result

    def apply_activation_plan(self, section: dict | None) -> None:
        """Replace the saved-activation setup by `section` (an activations config section from a new
        plan; None: store everything as autograd saves it). Called between optimizer steps."""
        if self._activation_memory is not None:
            self._activation_memory.close()
            self._activation_memory = None
        # The user's own settings (block size, rounding, attention and norm widths) stay.
        kept = {name: value for name, value in self.lazyzero_config.activations.model_dump().items()
                if name not in PLANNED_FIELDS["activations"]}
        settings = ActivationsConfig(**{**kept, **(section or {})})
        self.lazyzero_config.activations = settings
        if settings.enabled:
            self._activation_memory = ActivationMemory(self.module, settings, aio_config=self._config.aio_config)

    # --- saved activations (lazyzero/activations/engine_setup.py) ---------------------------------

    def forward(self, *inputs, **kwargs):
        if self._activation_memory is None:
            return super().forward(*inputs, **kwargs)
        with self._activation_memory.packer:
            return super().forward(*inputs, **kwargs)

    # --- 8-bit optimizer and fused clipping (lazyzero/optimizer/engine_setup.py) -------------------

    @property
    def uses_8bit_optimizer(self) -> bool:
        return self.lazyzero_config.optimizer.type != "none"

    def _configure_basic_optimizer(self, model_parameters):
        if not self.uses_8bit_optimizer:
            return super()._configure_basic_optimizer(model_parameters)
        return optimizer_setup.build_8bit_optimizer(self, model_parameters)

    def _configure_zero_optimizer(self, optimizer):
        # ZeRO-3 builds its NVMe optimizer swapper inside; 8-bit states need ours (nvme_8bit_swap.py).
        # A plan may swap only some layers' optimizer state (zero_placement.py).
        with eight_bit_state_swapping() if self.uses_8bit_optimizer else nullcontext(), \
                planned_zero_placement(self):
            zero_optimizer = super()._configure_zero_optimizer(optimizer)
        if self._fused_clipping:
            optimizer_setup.install_fused_clipping(self, zero_optimizer)
        return zero_optimizer

    @property
    def _fused_clipping(self) -> bool:
        return self.uses_8bit_optimizer and self.lazyzero_config.optimizer.fused_clipping

    def clip_fp32_gradients(self):
        # With fused clipping, stage 0's clip factor is applied inside the optimizer step.
        if not self._fused_clipping:
            super().clip_fp32_gradients()

    def _stage_0_fused_clipping(self) -> bool:
        return (self._fused_clipping and not self.zero_optimization()
                and not (self.fp16_enabled() or self.bfloat16_enabled()))

    # --- checkpoints (lazyzero/checkpoint/engine_hooks.py) ------------------------------------------

    def _configure_checkpointing(self):
        super()._configure_checkpointing()
        if self.lazy_checkpoints:
            self.checkpoint_engine = checkpointing.lazy_checkpoint_engine(self)

    @property
    def lazy_checkpoints(self) -> bool:
        return self.lazyzero_config.checkpoint.mode == "lazy"

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's save (same arguments), plus this rank's lazyzero state. With lazy checkpoints it
        returns once the snapshot is queued; the files are committed in the background."""
        if not self.lazy_checkpoints:
            return super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest,
                                           exclude_frozen_parameters=exclude_frozen_parameters)
        with checkpointing.lazy_save(self, save_dir, save_latest):
            # 'latest' is written by the background commit, by rename, once every file is durable.
            return super().save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False,
                                           exclude_frozen_parameters=exclude_frozen_parameters)

    def _save_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):  # noqa: B006 - DeepSpeed's signature
        super()._save_checkpoint(save_dir, tag, client_state=client_state, exclude_frozen_parameters=exclude_frozen_parameters)
        checkpointing.save_rank_state(self, save_dir, tag)

    def _save_zero_checkpoint(self, save_path, tag):
        super()._save_zero_checkpoint(save_path, tag)
        if self.lazy_checkpoints:
            checkpointing.snapshot_nvme_optimizer_files(self, save_path, tag)

    def zero_nvme_offload_optimizer(self):
        # During a lazy save DeepSpeed must not copy the swap folder itself (synchronously, outside
        # the commit): the snapshot reads it instead (snapshot_nvme_optimizer_files). During a
        # re-split load it must not copy this rank's saved swap files back (they hold another
        # layout) but call _load_zero_checkpoint, which reads every saved rank's.
        if getattr(self, "_inside_lazy_save", False) or self._resharding_zero3:
            return False
        return super().zero_nvme_offload_optimizer()

    def _take_model_step(self, lr_kwargs):
        if self.lazy_checkpoints:
            self.checkpoint_engine.before_optimizer_step()
        if self._stage_0_fused_clipping():
            optimizer_setup.stage_0_norm_and_clip(self)
        return super()._take_model_step(lr_kwargs)

    def wait_for_checkpoints(self) -> None:
        """Block until every queued lazy checkpoint is committed; raise if one failed (no-op otherwise)."""
        if self.lazy_checkpoints:
            self.checkpoint_engine.wait()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load (same arguments, same positions). A lazyzero checkpoint is verified against
        its manifest first, 'latest' falls back to the newest committed checkpoint, and this rank's
        lazyzero state is restored with the optimizer state."""
        if self.lazy_checkpoints:  # loading changes the state: a snapshot still being taken must end first
            self.checkpoint_engine.before_optimizer_step()
        tag = checkpointing.prepare_load(self, load_dir, tag)
        if tag is None:
            return None, None
        reshard = (self.uses_8bit_optimizer and load_optimizer_states and not load_module_only
                   and optimizer_reshard.reshard_needed(self, load_dir, tag))
        # ZeRO 1/2: DeepSpeed loads the weights, the states are re-split afterwards. ZeRO-3 keeps
        # load_optimizer_states on, so that DeepSpeed reads the module's placeholders and calls
        # _load_zero_checkpoint, where the re-split takes the place of its rank-count check.
        resplit_after_load = reshard and self.zero_optimization_stage() in (1, 2)
        self._resharding_zero3 = reshard and not resplit_after_load
        try:
            load_path, client_state = super().load_checkpoint(
                load_dir, tag=tag, load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states and not resplit_after_load,
                load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                custom_load_fn=custom_load_fn)
        finally:
            self._resharding_zero3 = False
        if resplit_after_load and load_path is not None:
            optimizer_reshard.restore_resharded_states(self, load_dir, tag)
        if load_path is not None and load_optimizer_states and not load_module_only:
            if self.zero_nvme_offload_optimizer() and not reshard:
                restore_nvme_offloaded_state(self, load_dir, tag)
            replay_cpu_adam_after_load(self)
            checkpointing.restore_rank_state(self, os.path.join(load_dir, tag))
        return load_path, client_state

    def _get_all_ckpt_names(self, checkpoints_path, tag):
        names = super()._get_all_ckpt_names(checkpoints_path, tag)
        if not names and self._resharding_zero3:
            # A rank beyond the saved ones: every ZeRO-3 rank's model states are alike.
            return [zero3_reshard.model_states_file(checkpoints_path, tag)]
        return names

    def _load_zero_checkpoint(self, load_dir, tag, load_optimizer_states=True):
        if not self._resharding_zero3:
            return super()._load_zero_checkpoint(load_dir, tag, load_optimizer_states=load_optimizer_states)
        optimizer_reshard.restore_resharded_states(self, load_dir, tag)
        return True

    def destroy(self):
        if self.lazy_checkpoints and getattr(self, "checkpoint_engine", None) is not None:
            self.checkpoint_engine.close()
        if getattr(self, "_activation_memory", None) is not None:
            self._activation_memory.close()
        super().destroy()

    def _keeps_rank_state(self) -> bool:
        return self.lazy_checkpoints or (self._gradient_exchange is not None
                                         and self._gradient_exchange.error_feedback is not None)

    def lazyzero_rank_state(self) -> dict:
        """Per-rank state of lazyzero features, saved in lazyzero_rank<R>.pt."""
        features = {}
        if self._gradient_exchange is not None and self._gradient_exchange.error_feedback is not None:
            features["gradients"] = self._gradient_exchange.state_dict()
        if self.lazy_checkpoints:
            features["rng"] = checkpointing.rng_state()
        return features
