"""Model presets and builders: real transformers architectures, randomly initialized or loaded with
real pretrained weights from local files, never downloaded.

Names are resolved on first use (PEP 562), so that reading the presets (`lazyzero.models.presets`,
the command line's help) imports neither torch nor transformers."""

from lazyzero._lazy_names import lazy_names

_HOMES = {
    "ATTENTION_IMPLEMENTATION": "build", "build_model": "build",
    "DEFAULT_FAMILY": "config", "FAMILIES": "config", "model_config": "config",
    "count_parameters": "params",
    "PRESETS": "presets", "ModelPreset": "presets",
    "NAMED_MODELS": "pretrained", "REAL_MODEL_INSTALL": "pretrained", "MissingModelPackage": "pretrained",
    "PretrainedFiles": "pretrained", "pretrained_files": "pretrained",
}

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = sorted(_HOMES)
