"""The capabilities as engine features: one object per config section, built from it, called through
optional hooks. `LazyZeroEngine` overrides DeepSpeed's own methods once and, in each, calls the hook
of that name on every feature in `FEATURES` order; it names no feature (docs/architecture.md).

A feature is any object with some of these methods (none is required; a feature switched off in the
config keeps every hook a no-op, so the engine then runs DeepSpeed's code path unchanged):

before DeepSpeed builds anything (`lazyzero.initialize`)
- `prepare_run(model, ds_config, lazyzero_config, dist) -> (ds_config, lazyzero_config)`
- `check_parsed_config(config_class, model)`        after DeepSpeed parsed the final config
- `check_engine_arguments(client_optimizer, config_class)`
inside and after DeepSpeed's engine constructor
- `build_basic_optimizer(engine, model_parameters) -> optimizer | None`   the first answer wins
- `around_zero_optimizer_build(engine) -> context manager`
- `after_zero_optimizer_build(engine, zero_optimizer)`
- `checkpoint_engine(engine) -> CheckpointEngine | None`                  the first answer wins
- `attach(engine)`                                  the engine is built
training
- `around_forward(engine) -> context manager`, `replaces_clip_pass(engine) -> bool`,
  `before_model_step(engine)`, `after_optimizer_step(engine)`
- `reconfigure(engine, section, settings)`          a new plan for `section` (its config dict, or None)
checkpoints
- `check_save_tag(engine, tag)` (a tag given to save_checkpoint),
  `around_save(engine, save_dir, save_latest) -> context manager`, `writes_latest_itself(engine) -> bool`,
  `after_zero_checkpoint_saved(engine, save_path, tag)`, `hides_optimizer_swap_folder(engine) -> bool`
- `resolve_load_tag(engine, load_dir, tag) -> str | None` (the first feature that has it answers),
  `before_load(engine, request)`, `plan_load(engine, request)`, `load_zero_checkpoint(engine, request) -> bool`,
  `checkpoint_names_when_missing(engine, request, path) -> list | None`, `after_load(engine, request)`
- `keeps_rank_state(engine) -> bool`, `rank_state(engine) -> dict`, `load_rank_state(engine, state)`,
  `wait(engine)`
reporting and the end
- `step_metrics(engine) -> dict`, `report(engine) -> dict`, `close(engine)`
"""

from __future__ import annotations

import importlib
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

# Config section -> the feature class in its capability package. The order is the order of every
# hook call: re-split optimizer states (optimizer) are restored before the checkpoint feature replays
# the host optimizer and reads the per-rank state, and step metrics keep this order in the logs.
FEATURES = {
    "plan": "lazyzero.plan.feature:PlanFeature",
    "activations": "lazyzero.activations.feature:ActivationsFeature",
    "optimizer": "lazyzero.optimizer.feature:EightBitOptimizerFeature",
    "gradients": "lazyzero.gradients.feature:Int8GradientsFeature",
    "checkpoint": "lazyzero.checkpoint.feature:CheckpointFeature",
}


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


class FeatureSet:
    """Every capability's feature object, built from the validated "lazyzero" section."""

    def __init__(self, lazyzero_config, **inputs):
        self.by_section = {section: _feature_class(path)(lazyzero_config, **inputs)
                           for section, path in FEATURES.items()}

    def call(self, hook: str, *args) -> list:
        """`hook(*args)` on every feature that has it, in order; their answers."""
        return [getattr(feature, hook)(*args) for feature in self.by_section.values() if hasattr(feature, hook)]

    def first(self, hook: str, *args):
        """The first answer of `hook` that is not None (None when no feature answers)."""
        for feature in self.by_section.values():
            if hasattr(feature, hook):
                answer = getattr(feature, hook)(*args)
                if answer is not None:
                    return answer
        return None

    def any(self, hook: str, *args) -> bool:
        return any(self.call(hook, *args))

    @contextmanager
    def around(self, hook: str, *args) -> Iterator[None]:
        """Every feature's context manager of `hook`, entered in order."""
        with ExitStack() as stack:
            for context in self.call(hook, *args):
                if context is not None:
                    stack.enter_context(context)
            yield

    def merged(self, hook: str, *args) -> dict:
        merged = {}
        for part in self.call(hook, *args):
            merged.update(part or {})
        return merged

    def section(self, name: str):
        return self.by_section[name]


def _feature_class(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
