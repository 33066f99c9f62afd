"""The seam between the engine and the capabilities is a type (docs/architecture.md): every feature
subclasses `Feature`, defines no public method the base class lacks (a misspelled hook would never
be called), keeps each hook's parameters, and every hook is called by the engine."""

import inspect
from pathlib import Path

import pytest

from lazyzero.engine.features import FEATURES, FeatureSet
from lazyzero.feature import Feature

PACKAGE = Path(__file__).resolve().parents[2] / "lazyzero"
HOOKS = {name for name, value in vars(Feature).items() if inspect.isfunction(value) and not name.startswith("_")}


@pytest.mark.parametrize("section", list(FEATURES))
def test_each_feature_overrides_only_hooks_of_the_base_class_with_their_parameters(section):
    feature_class = FEATURES[section]
    assert issubclass(feature_class, Feature)
    for name, value in vars(feature_class).items():
        if name.startswith("_") or not inspect.isfunction(value):
            continue  # private helpers, properties
        assert name in HOOKS, f"{feature_class.__name__}.{name} is not a hook of Feature (misspelled?)"
        expected = list(inspect.signature(getattr(Feature, name)).parameters)
        assert list(inspect.signature(value).parameters)[:len(expected)] == expected, (feature_class, name)


def test_every_hook_is_called_by_the_engine():
    sources = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py") if path != PACKAGE / "feature.py")
    uncalled = sorted(name for name in HOOKS if f"Feature.{name}," not in sources and f"Feature.{name})" not in sources)
    assert not uncalled, f"hooks no engine code calls: {uncalled}"


def test_a_function_that_is_not_a_hook_is_refused():
    features = FeatureSet.__new__(FeatureSet)
    features.by_section = {}

    def attach(engine):
        return None

    with pytest.raises(TypeError, match="not a hook"):
        features.call(attach, None)
