"""Model presets and builders: real transformers architectures, randomly initialized or loaded with
real pretrained weights from local files, never downloaded.

Names are resolved on first use (PEP 562), so that reading the presets (`lazyzero.models.presets`,
the command line's help) imports neither torch nor transformers."""

import importlib

_WHERE = {
    "ATTENTION_IMPLEMENTATION": "build", "build_model": "build",
    "DEFAULT_FAMILY": "config", "FAMILIES": "config", "model_config": "config",
    "count_parameters": "params",
    "PRESETS": "presets", "ModelPreset": "presets",
    "NAMED_MODELS": "pretrained", "REAL_MODEL_INSTALL": "pretrained", "MissingModelPackage": "pretrained",
    "PretrainedFiles": "pretrained", "pretrained_files": "pretrained",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lazyzero.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lazyzero.models.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
