"""The capabilities as engine features: one `Feature` subclass per config section, built from it.
`LazyZeroEngine` overrides DeepSpeed's own methods once and, in each, calls the hook of that moment
on every feature in `FEATURES` order, as a method of `Feature` (`features.call(Feature.attach,
engine)`): a misspelled hook fails at once, and tests/engine/test_feature_protocol.py fails when a
feature defines a public method the base class does not. The engine names no feature
(docs/architecture.md). Every hook is a documented no-op of `Feature` (lazyzero/feature.py); a feature
switched off in the config keeps each of its hooks a no-op, so the engine then runs DeepSpeed's code path unchanged.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

from lazyzero.activations.feature import ActivationsFeature
from lazyzero.checkpoint.feature import CheckpointFeature
from lazyzero.feature import Feature
from lazyzero.gradients.feature import Int8GradientsFeature
from lazyzero.optimizer.feature import EightBitOptimizerFeature
from lazyzero.plan.feature import PlanFeature

Hook = Callable[..., Any]  # a method of Feature, e.g. Feature.attach

# Config section -> its feature class. The order is the order of every hook call: re-split optimizer
# states (optimizer) are restored before the checkpoint feature replays the host optimizer and reads
# the per-rank state, and step metrics keep this order in the logs.
FEATURES: dict[str, type[Feature]] = {
    "plan": PlanFeature,
    "activations": ActivationsFeature,
    "optimizer": EightBitOptimizerFeature,
    "gradients": Int8GradientsFeature,
    "checkpoint": CheckpointFeature,
}


class FeatureSet:
    """Every capability's feature object, built from the validated "lazyzero" section."""

    def __init__(self, lazyzero_config, **inputs):
        self.by_section = {section: feature_class(lazyzero_config, **inputs)
                           for section, feature_class in FEATURES.items()}

    def call(self, hook: Hook, *args) -> list:
        """`hook(*args)` on every feature, in order; their answers."""
        name = _hook_name(hook)
        return [getattr(feature, name)(*args) for feature in self.by_section.values()]

    def first(self, hook: Hook, *args):
        """The first answer of `hook` that is not None (None when no feature answers)."""
        name = _hook_name(hook)
        for feature in self.by_section.values():
            answer = getattr(feature, name)(*args)
            if answer is not None:
                return answer
        return None

    def any(self, hook: Hook, *args) -> bool:
        return any(self.call(hook, *args))

    @contextmanager
    def around(self, hook: Hook, *args) -> Iterator[None]:
        """Every feature's context manager of `hook`, entered in order."""
        with ExitStack() as stack:
            for context in self.call(hook, *args):
                stack.enter_context(context)
            yield

    def merged(self, hook: Hook, *args) -> dict:
        merged = {}
        for part in self.call(hook, *args):
            merged.update(part)
        return merged

    def section(self, name: str) -> Feature:
        return self.by_section[name]


def call_on_classes(hook: Hook) -> list:
    """A class-level hook (`Feature.refusals`, `Feature.patch_trainers`, ...) of every feature class."""
    name = _hook_name(hook)
    return [getattr(feature_class, name)() for feature_class in FEATURES.values()]


def _hook_name(hook: Hook) -> str:
    name = getattr(hook, "__name__", None)
    declared = getattr(Feature, name or "", None)
    if declared is None or getattr(declared, "__func__", declared) is not getattr(hook, "__func__", hook):
        raise TypeError(f"{hook!r} is not a hook of lazyzero.feature.Feature")
    return name
