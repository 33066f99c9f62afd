"""The typed "lazyzero" section of a DeepSpeed config: models, validation, and its documentation.

    from lazyzero.config import validate_ds_config
    config = validate_ds_config("ds_config.json")   # LazyZeroConfig, or LazyZeroConfigError listing every problem

Importing this package does not import torch or DeepSpeed, nor any of its modules: names resolve on first
use, so that a capability's section module (`lazyzero/gradients/config.py`), which imports the helpers
here and is composed by `models.py`, can be imported first without a cycle.
"""

from importlib import import_module

_HOMES = {
    "LazyZeroConfigError": "errors",
    "parse_memory_size": "memory",
    **dict.fromkeys(("ActivationsConfig", "CheckpointConfig", "DistributedConfig", "GradientsConfig",
                     "LazyZeroConfig", "OptimizerConfig", "PlanConfig"), "models"),
    "config_reference_markdown": "reference", "format_config_summary": "reference",
    "trainer_filled_keys": "trainer_values",
    "check_config_file": "validate", "load_ds_config_file": "validate", "validate_ds_config": "validate",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ActivationsConfig",
    "CheckpointConfig",
    "DistributedConfig",
    "GradientsConfig",
    "LazyZeroConfig",
    "LazyZeroConfigError",
    "OptimizerConfig",
    "PlanConfig",
    "check_config_file",
    "config_reference_markdown",
    "format_config_summary",
    "load_ds_config_file",
    "parse_memory_size",
    "trainer_filled_keys",
    "validate_ds_config",
]
