"""The 8-bit optimizer as an engine feature (lazyzero/engine/features.py): built where DeepSpeed
builds its Adam, its NVMe swapper and fused clipping installed around and after ZeRO's optimizer,
and its states re-split when a checkpoint was saved on another number of ranks."""

from __future__ import annotations

from contextlib import nullcontext

from lazyzero.feature import Feature
from lazyzero.optimizer import engine_setup, zero3_reshard
from lazyzero.optimizer import reshard as optimizer_reshard
from lazyzero.optimizer.state_swapping import eight_bit_state_swapping


class EightBitOptimizerFeature(Feature):
    def __init__(self, lazyzero_config, **_):
        self.config = lazyzero_config
        self.resharding_zero3 = False  # only inside load_checkpoint

    @property
    def on(self) -> bool:
        return self.config.optimizer.enabled

    @property
    def fused_clipping(self) -> bool:
        return self.on and self.config.optimizer.fused_clipping

    def check_engine_arguments(self, client_optimizer, config_class) -> None:
        engine_setup.check_optimizer_source(self.config, client_optimizer, config_class)

    def build_basic_optimizer(self, engine, model_parameters):
        return engine_setup.build_8bit_optimizer(engine, model_parameters) if self.on else None

    def around_zero_optimizer_build(self, engine):
        # ZeRO-3 builds its NVMe optimizer swapper inside; 8-bit states need ours (nvme_swap.py).
        return eight_bit_state_swapping() if self.on else nullcontext()

    def after_zero_optimizer_build(self, engine, zero_optimizer) -> None:
        if self.fused_clipping:
            engine_setup.install_fused_clipping(engine, zero_optimizer)

    def replaces_clip_pass(self, engine) -> bool:
        # With fused clipping, stage 0's clip factor is applied inside the optimizer step.
        return self.fused_clipping

    def before_model_step(self, engine) -> None:
        if self.fused_clipping and not engine.zero_optimization() and not (engine.fp16_enabled()
                                                                            or engine.bfloat16_enabled()):
            engine_setup.stage_0_norm_and_clip(engine)

    # --- loading on another number of ranks (reshard.py, zero3_reshard.py) ------------------------

    def plan_load(self, engine, request) -> None:
        """ZeRO 1/2: DeepSpeed loads the weights, the states are re-split afterwards. ZeRO-3 keeps
        load_optimizer_states on, so that DeepSpeed reads the module's placeholders and calls
        _load_zero_checkpoint, where the re-split takes the place of its rank-count check."""
        request.resharded = (self.on and request.load_optimizer_states and not request.load_module_only
                             and optimizer_reshard.reshard_needed(engine, request.load_dir, request.tag))
        resplit_after_load = request.resharded and engine.zero_optimization_stage() in (1, 2)
        request.deepspeed_loads_optimizer_states = request.load_optimizer_states and not resplit_after_load
        self.resharding_zero3 = request.resharded and not resplit_after_load

    def hides_optimizer_swap_folder(self, engine) -> bool:
        # During a re-split load DeepSpeed must not copy this rank's saved swap files back (they hold
        # another layout) but call _load_zero_checkpoint, which reads every saved rank's.
        return self.resharding_zero3

    def checkpoint_names_when_missing(self, engine, request, checkpoints_path):
        # A rank beyond the saved ones: every ZeRO-3 rank's model states are alike.
        return [zero3_reshard.model_states_file(checkpoints_path, request.tag)] if self.resharding_zero3 else None

    def load_zero_checkpoint(self, engine, request) -> bool:
        if not self.resharding_zero3:
            return False
        optimizer_reshard.restore_resharded_states(engine, request.load_dir, request.tag)
        return True

    def end_load(self, engine, request) -> None:
        self.resharding_zero3 = False

    def after_load(self, engine, request) -> None:
        if request.resharded and not request.deepspeed_loads_optimizer_states and request.load_path is not None:
            optimizer_reshard.restore_resharded_states(engine, request.load_dir, request.tag)

    def step_metrics(self, engine) -> dict:
        """`optimizer_state_bytes`: this rank's moment state held in memory (codes, scales and the
        fp32 moments of the groups that keep them; sub-groups swapped out to NVMe are not counted)."""
        return {"optimizer_state_bytes": engine.basic_optimizer.state_bytes()} if self.on else {}
