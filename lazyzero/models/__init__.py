"""Model presets and builders: real transformers architectures, randomly initialized, never downloaded."""

from lazyzero.models.build import ATTENTION_IMPLEMENTATION, build_model
from lazyzero.models.config import DEFAULT_FAMILY, FAMILIES, model_config
from lazyzero.models.params import count_parameters
from lazyzero.models.presets import PRESETS, ModelPreset

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "DEFAULT_FAMILY",
    "FAMILIES",
    "PRESETS",
    "ModelPreset",
    "build_model",
    "count_parameters",
    "model_config",
]
