"""The typed "lazyzero" section of a DeepSpeed config: models, validation, and its documentation.

    from lazyzero.config import validate_ds_config
    config = validate_ds_config("ds_config.json")   # LazyZeroConfig, or LazyZeroConfigError listing every problem

Importing this package does not import torch or DeepSpeed.
"""

from lazyzero.config.errors import LazyZeroConfigError
from lazyzero.config.memory import parse_memory_size
from lazyzero.config.models import (
    ActivationsConfig,
    CheckpointConfig,
    DistributedConfig,
    GradientsConfig,
    LazyZeroConfig,
    OptimizerConfig,
    PlanConfig,
)
from lazyzero.config.reference import config_reference_markdown, format_config_summary
from lazyzero.config.trainer_values import trainer_filled_keys
from lazyzero.config.validate import check_config_file, load_ds_config_file, validate_ds_config

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
