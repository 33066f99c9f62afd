"""The typed "lazyzero" section of a DeepSpeed config: models, validation, and its documentation.

    from lazyzero.config import validate_ds_config
    config = validate_ds_config("ds_config.json")   # LazyZeroConfig, or LazyZeroConfigError listing every problem

Importing this package does not import torch or DeepSpeed, nor any of its modules: names resolve on first
use, so that a capability's section module (`lazyzero/gradients/config.py`), which imports the helpers
here and is composed by `models.py`, can be imported first without a cycle.
"""

from lazyzero._lazy_names import lazy_names

_HOMES = {
    "LazyZeroConfigError": "errors",
    "parse_memory_size": "memory",
    **dict.fromkeys(("ActivationsConfig", "CheckpointConfig", "DistributedConfig", "GradientsConfig",
                     "LazyZeroConfig", "OptimizerConfig", "PlanConfig"), "models"),
    "config_reference_markdown": "reference", "format_config_summary": "reference",
    "trainer_filled_keys": "trainer_values",
    "check_config_file": "validate", "load_ds_config_file": "validate", "validate_ds_config": "validate",
}

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = sorted(_HOMES)
