"""Checkpoints as an engine feature (lazyzero/engine/features.py). Always part of the engine:
whatever the settings it verifies a checkpoint against its manifest before loading it and saves
and restores the per-rank state other features keep (lazyzero_rank<R>.pt); with
`checkpoint.enabled` it also makes saves lazy (docs/checkpoint.md): DeepSpeed's save returns once
the snapshot is queued and the files are committed in the background."""

from __future__ import annotations

import os
from contextlib import nullcontext

from lazyzero.checkpoint import engine_hooks
from lazyzero.checkpoint.folder_layout import UnsafeCheckpointPath, check_tag, read_latest
from lazyzero.checkpoint.job_end import finish_pending_checkpoints
from lazyzero.checkpoint.lazy_engine import CheckpointFailedError
from lazyzero.checkpoint.manifest import CheckpointDamagedError
from lazyzero.checkpoint.nvme_restore import replay_cpu_adam_after_load, restore_nvme_offloaded_state
from lazyzero.checkpoint.preemption import StopOnSigterm, stop_message
from lazyzero.checkpoint.trainer_routes import route_trainer_folder_rules, unroute_trainer_folder_rules
from lazyzero.checkpoint.verified_read import VerifiedFiles
from lazyzero.feature import Feature


class CheckpointFeature(Feature):
    def __init__(self, lazyzero_config, **_):
        self.config = lazyzero_config
        self.inside_lazy_save = False
        self.verified = VerifiedFiles()
        self.stop: StopOnSigterm | None = None
        self.last_save_dir: str | None = None
        self.gather_hooks: list = []

    @classmethod
    def refusals(cls) -> tuple[type[BaseException], ...]:
        # A checkpoint a rank refuses to load or cannot save: damaged, leading outside its folder,
        # larger than its disk (docs/reliability.md, guarantee 9).
        return CheckpointDamagedError, UnsafeCheckpointPath, CheckpointFailedError

    @classmethod
    def patch_trainers(cls) -> None:
        route_trainer_folder_rules()

    @classmethod
    def unpatch_trainers(cls) -> None:
        unroute_trainer_folder_rules()

    @property
    def lazy(self) -> bool:
        return self.config.checkpoint.enabled

    def checkpoint_engine(self, engine):
        return engine_hooks.lazy_checkpoint_engine(engine, self.verified) if self.lazy else None

    def attach(self, engine) -> None:
        if not self.lazy:
            engine_hooks.route_deepspeed_loads(engine, self.verified)
            return
        self.stop = engine_hooks.stop_on_sigterm(engine)
        self.gather_hooks = engine_hooks.pause_background_during_gathers(engine, engine.checkpoint_engine.pace)

    # --- saving ----------------------------------------------------------------------------------

    def check_save_tag(self, engine, tag) -> None:
        # A tag is one folder directly under save_dir, lazy or not (docs/reliability.md, guarantee 2).
        check_tag(str(tag))

    def around_save(self, engine, save_dir, save_latest):
        self.last_save_dir = str(save_dir)
        return engine_hooks.lazy_save(engine, self, save_dir, save_latest) if self.lazy else nullcontext()

    def writes_latest_itself(self, engine) -> bool:
        # 'latest' is written by the background commit, by rename, once every file is durable.
        return self.lazy

    def after_deepspeed_saved(self, engine, save_dir, tag) -> None:
        engine_hooks.save_rank_state(engine, save_dir, tag)

    def after_zero_checkpoint_saved(self, engine, save_path, tag) -> None:
        if self.lazy:
            engine_hooks.snapshot_nvme_optimizer_files(engine, save_path, tag)

    def hides_optimizer_swap_folder(self, engine) -> bool:
        # During a lazy save DeepSpeed must not copy the swap folder itself (synchronously, outside
        # the commit): the snapshot reads it instead (snapshot_nvme_optimizer_files).
        return self.inside_lazy_save

    def before_model_step(self, engine) -> None:
        if self.lazy:
            engine.checkpoint_engine.before_optimizer_step()

    def after_optimizer_step(self, engine) -> None:
        if self.lazy:
            engine.checkpoint_engine.after_optimizer_step()
        # Every rank reaches each optimizer step: where they agree on a SIGTERM (preemption.py).
        if self.stop is None or not self.stop.agree(engine.global_steps) or self.stop.claimed_by:
            return
        saved = None
        if self.config.checkpoint.save_on_sigterm and self.last_save_dir is not None:
            engine.save_checkpoint(self.last_save_dir)
            saved = f"global_step{engine.global_steps} in {self.last_save_dir}"
        finish_pending_checkpoints(close=True)
        self.stop.uninstall()
        newest = read_latest(self.last_save_dir) if self.last_save_dir else None
        self.stop.exit(stop_message(self.stop.stop_step, saved, newest and f"{newest} in {self.last_save_dir}"))

    def wait(self, engine) -> None:
        if self.lazy:
            engine.checkpoint_engine.wait()

    # --- loading ---------------------------------------------------------------------------------

    def before_load(self, engine) -> None:
        # Loading changes the state: a snapshot still being taken must end first.
        if self.lazy:
            engine.checkpoint_engine.wait_for_snapshots()

    def resolve_load_tag(self, engine, load_dir, tag):
        return engine_hooks.prepare_load(engine, self.lazy, load_dir, tag, self.verified)

    def end_load(self, engine, request) -> None:
        # After a load that read nothing or failed; otherwise after_load still reads the tag's files.
        if request.load_path is None:
            self.verified.clear()

    def after_load(self, engine, request) -> None:
        try:
            if request.load_path is None or not request.load_optimizer_states or request.load_module_only:
                return
            if engine.zero_nvme_offload_optimizer() and not request.resharded:
                restore_nvme_offloaded_state(engine, request.load_dir, request.tag)
            replay_cpu_adam_after_load(engine)
            engine_hooks.restore_rank_state(engine, os.path.join(request.load_dir, request.tag), self.verified)
        finally:
            self.verified.clear()

    # --- per-rank state and the end --------------------------------------------------------------

    def keeps_rank_state(self, engine) -> bool:
        return self.lazy

    def rank_state(self, engine) -> dict:
        return {"rng": engine_hooks.rng_state()} if self.lazy else {}

    def load_rank_state(self, engine, state: dict) -> None:
        if "rng" in state:
            engine_hooks.restore_rng_state(state["rng"])

    def step_metrics(self, engine) -> dict:
        """This rank's figures of the newest committed checkpoint: `checkpoint_tag`, `checkpoint_bytes`
        (`checkpoint_direct_bytes` of them serialized straight from training's memory),
        `checkpoint_host_bytes` (the host buffers and staging blocks it holds since),
        `checkpoint_copy_s` (from `save_checkpoint` returning to the snapshot taken),
        `checkpoint_step_wait_s` (what optimizer steps waited for it), `checkpoint_write_s` (to this
        rank's files durable) and `checkpoint_commit_s` (to the commit)."""
        commit = engine.checkpoint_engine.last_commit if self.lazy else None
        if commit is None:
            return {}
        return dict(checkpoint_tag=commit["tag"], checkpoint_bytes=commit["bytes"],
                    checkpoint_direct_bytes=commit["direct_bytes"], checkpoint_host_bytes=commit["host_bytes"],
                    checkpoint_step_wait_s=commit["step_wait_s"],
                    checkpoint_copy_s=commit["copy_s"], checkpoint_write_s=commit["write_s"],
                    checkpoint_commit_s=commit["queued_to_committed_s"])

    def close(self, engine) -> None:
        engine_hooks.remove_hooks(self.gather_hooks)
        if self.stop is not None:
            self.stop.uninstall()
        if self.lazy and getattr(engine, "checkpoint_engine", None) is not None:
            engine.checkpoint_engine.close(self.config.checkpoint.exit_timeout_s)
