"""The seam between the engine and the capabilities is a type (docs/architecture.md): every feature
subclasses `Feature`, defines no public method the base class lacks (a misspelled hook would never
be called), keeps each hook's parameters, and every hook is called by the engine."""

import inspect
from pathlib import Path

import pytest

from lazyzero.engine.features import FEATURES, FeatureSet
from lazyzero.feature import Feature

PACKAGE = Path(__file__).resolve().parents[2] / "lazyzero"
def _function(value):
    """The function of a method or class method defined in a class body; None for anything else."""
    value = value.__func__ if isinstance(value, classmethod) else value
    return value if inspect.isfunction(value) else None


HOOKS = {name for name, value in vars(Feature).items() if _function(value) and not name.startswith("_")}


@pytest.mark.parametrize("section", list(FEATURES))
def test_each_feature_overrides_only_hooks_of_the_base_class_with_their_parameters(section):
    feature_class = FEATURES[section]
    assert issubclass(feature_class, Feature)
    for name, value in vars(feature_class).items():
        if name.startswith("_") or not _function(value):
            continue  # private helpers, properties
        assert name in HOOKS, f"{feature_class.__name__}.{name} is not a hook of Feature (misspelled?)"
        assert isinstance(value, classmethod) == isinstance(vars(Feature)[name], classmethod), (feature_class, name)
        expected = list(inspect.signature(_function(vars(Feature)[name])).parameters)
        assert list(inspect.signature(_function(value)).parameters)[:len(expected)] == expected, (feature_class, name)


def test_every_hook_is_called_by_the_engine():
    sources = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py") if path != PACKAGE / "feature.py")
    uncalled = sorted(name for name in HOOKS if f"Feature.{name}," not in sources and f"Feature.{name})" not in sources)
    assert not uncalled, f"hooks no engine code calls: {uncalled}"


def test_no_engine_module_but_the_registry_names_a_capability():
    """The engine reaches the capabilities only through the registry (engine/features.py) and the
    Feature hooks, class-level ones included (refusals, patch_trainers)."""
    from test_package_layers import CAPABILITIES, imports_of

    for path in sorted((PACKAGE / "engine").glob("*.py")):
        if path.name != "features.py":
            assert not imports_of(path) & CAPABILITIES, path


def test_a_function_that_is_not_a_hook_is_refused():
    features = FeatureSet.__new__(FeatureSet)
    features.by_section = {}

    def attach(engine):
        return None

    with pytest.raises(TypeError, match="not a hook"):
        features.call(attach, None)
