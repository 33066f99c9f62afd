"""Model presets and builders: real transformers architectures, randomly initialized or loaded with
real pretrained weights from local files, never downloaded."""

from lazyzero.models.build import ATTENTION_IMPLEMENTATION, build_model
from lazyzero.models.config import DEFAULT_FAMILY, FAMILIES, model_config
from lazyzero.models.params import count_parameters
from lazyzero.models.presets import PRESETS, ModelPreset
from lazyzero.models.pretrained import (
                                        NAMED_MODELS,
                                        REAL_MODEL_INSTALL,
                                        MissingModelPackage,
                                        PretrainedFiles,
                                        pretrained_files,
)

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "DEFAULT_FAMILY",
    "FAMILIES",
    "NAMED_MODELS",
    "PRESETS",
    "REAL_MODEL_INSTALL",
    "MissingModelPackage",
    "ModelPreset",
    "PretrainedFiles",
    "build_model",
    "count_parameters",
    "model_config",
    "pretrained_files",
]
