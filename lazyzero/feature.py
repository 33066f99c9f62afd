"""`Feature`: the base class of the capabilities' engine features, every hook a documented no-op
(docs/architecture.md). `LazyZeroEngine` calls the hooks through `FeatureSet` (features.py), as
methods of this class; a capability's feature overrides the ones it needs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any


@dataclass
class LoadRequest:
    """One `load_checkpoint` call, as the features see and shape it."""

    load_dir: str
    tag: str
    load_optimizer_states: bool
    load_module_only: bool
    # Set by the features in `plan_load`:
    deepspeed_loads_optimizer_states: bool = True
    resharded: bool = False
    load_path: Any = None


class Feature:
    """One capability's part in the engine. Subclasses override the hooks they need; `config` is the
    validated "lazyzero" section, `inputs` what features' `prepare_run` returned for the engine's."""

    def __init__(self, lazyzero_config, **inputs):
        self.config = lazyzero_config

    # --- the process, before any engine -----------------------------------------------------------

    @classmethod
    def refusals(cls) -> tuple[type[BaseException], ...]:
        """The capability's error types that refuse a user's input (a file, a folder, a launch): an
        uncaught one ends the job with its message as one line (distributed/refusal_line.py)."""
        return ()

    @classmethod
    def patch_trainers(cls) -> None:
        """`lazyzero.patch_deepspeed()`: change what the trainers (Hugging Face, Accelerate, Lightning)
        must do differently for this capability, through the patch point."""

    @classmethod
    def unpatch_trainers(cls) -> None:
        """`lazyzero.unpatch_deepspeed()`: undo `patch_trainers`."""

    # --- before DeepSpeed builds anything (lazyzero.initialize) -----------------------------------

    def prepare_run(self, model, ds_config: dict, lazyzero_config, dist) -> dict | None:
        """Rewrite the run before DeepSpeed reads it: a dict with the new "ds_config" and
        "lazyzero_config", and inputs for the engine's features (keyword arguments); None: unchanged."""
        return None

    def check_parsed_config(self, config_class, model) -> None:
        """After DeepSpeed parsed the final config: refuse what it made of it."""

    def check_engine_arguments(self, client_optimizer, config_class) -> None:
        """Before DeepSpeed's engine constructor: refuse arguments the feature cannot work with."""

    # --- inside and after DeepSpeed's engine constructor ------------------------------------------

    def build_basic_optimizer(self, engine, model_parameters):
        """The optimizer DeepSpeed would build from the config, or None (the first answer wins)."""
        return None

    def around_zero_optimizer_build(self, engine) -> AbstractContextManager:
        """Entered while DeepSpeed builds its ZeRO optimizer."""
        return nullcontext()

    def after_zero_optimizer_build(self, engine, zero_optimizer) -> None:
        """The ZeRO optimizer is built."""

    def checkpoint_engine(self, engine):
        """A CheckpointEngine in place of DeepSpeed's, or None (the first answer wins)."""
        return None

    def attach(self, engine) -> None:
        """The engine is built."""

    # --- training ---------------------------------------------------------------------------------

    def around_forward(self, engine) -> AbstractContextManager:
        """Entered around every forward."""
        return nullcontext()

    def replaces_clip_pass(self, engine) -> bool:
        """Whether DeepSpeed's separate gradient-clipping pass is skipped (the feature clips)."""
        return False

    def before_model_step(self, engine) -> None:
        """The optimizer is about to change the state."""

    def after_optimizer_step(self, engine) -> None:
        """An optimizer step ended (global_steps advanced); every rank reaches it."""

    def reconfigure(self, engine, section: str, settings: dict | None) -> None:
        """A new plan for config section `section` (its settings, or None: off), between steps."""

    # --- saving -----------------------------------------------------------------------------------

    def check_save_tag(self, engine, tag) -> None:
        """A tag given to save_checkpoint: refuse one that is not allowed."""

    def around_save(self, engine, save_dir, save_latest) -> AbstractContextManager:
        """Entered around DeepSpeed's save_checkpoint."""
        return nullcontext()

    def writes_latest_itself(self, engine) -> bool:
        """Whether the feature writes 'latest' (DeepSpeed then must not)."""
        return False

    def after_deepspeed_saved(self, engine, save_dir, tag) -> None:
        """DeepSpeed wrote (or queued) its files of the checkpoint; before 'latest'."""

    def after_zero_checkpoint_saved(self, engine, save_path, tag) -> None:
        """DeepSpeed saved this rank's ZeRO optimizer file."""

    def hides_optimizer_swap_folder(self, engine) -> bool:
        """Whether DeepSpeed must not copy the NVMe optimizer swap folder itself now."""
        return False

    def wait(self, engine) -> None:
        """Block until what the feature writes in the background is durable (wait_for_checkpoints)."""

    # --- loading ----------------------------------------------------------------------------------

    def before_load(self, engine) -> None:
        """load_checkpoint is about to change the state."""

    def resolve_load_tag(self, engine, load_dir, tag) -> str | None:
        """The tag to load (the first answer wins; None from every feature: nothing to load)."""
        return None

    def plan_load(self, engine, request: LoadRequest) -> None:
        """Shape `request` before DeepSpeed loads (which optimizer states DeepSpeed reads itself)."""

    def load_zero_checkpoint(self, engine, request: LoadRequest) -> bool:
        """Whether the feature loaded the ZeRO optimizer state in DeepSpeed's place."""
        return False

    def checkpoint_names_when_missing(self, engine, request: LoadRequest, checkpoints_path) -> list | None:
        """The model files to load when DeepSpeed finds none for this number of ranks."""
        return None

    def end_load(self, engine, request: LoadRequest) -> None:
        """DeepSpeed's load returned or raised."""

    def after_load(self, engine, request: LoadRequest) -> None:
        """DeepSpeed's load succeeded: restore the feature's own state."""

    def keeps_rank_state(self, engine) -> bool:
        """Whether the feature has per-rank state for lazyzero_rank<R>.pt."""
        return False

    def rank_state(self, engine) -> dict:
        """This rank's state of the feature, saved in lazyzero_rank<R>.pt (tensors, numbers, containers)."""
        return {}

    def load_rank_state(self, engine, state: dict) -> None:
        """The merged per-rank state of a loaded checkpoint."""

    # --- reporting and the end --------------------------------------------------------------------

    def step_metrics(self, engine) -> dict:
        """Figures of the last optimizer step for the training log."""
        return {}

    def report(self, engine) -> dict:
        """What the feature adds to the run report."""
        return {}

    def close(self, engine) -> None:
        """engine.destroy(): release what the feature holds."""
