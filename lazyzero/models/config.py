"""Model configs from a preset name, a named real model, a GGUF file, a config.json file or a local
checkpoint folder.

Nothing here downloads: presets are built from `PRESETS`, paths are read from the local disk, named
real models from the files their packages installed (lazyzero/models/pretrained.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import GPT2Config, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

from lazyzero.models.presets import PRESETS, ModelPreset
from lazyzero.models.pretrained import NAMED_MODELS, checkpoint_weights_folder, gguf_config, gguf_files

DEFAULT_FAMILY = "llama"
FAMILIES = ("llama", "qwen2", "mistral", "gpt2")
_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
_CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gpt2": GPT2Config}


def model_config(
    spec: str,
    family: str | None = None,
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> PretrainedConfig:
    """Config for `spec`: a preset name, a named real model (`NAMED_MODELS`), a .gguf file, a
    config.json path, or a folder holding config.json.

    For presets, `family` picks the architecture (default llama) and `vocab_size` / `max_positions`
    override the preset's. For paths and real models, the family is the model's own (a different
    `family` is an error); the overrides apply to a bare config, while a model with weights can only
    be asked for sizes it already covers (its embeddings cannot grow).
    """
    if family is not None and family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; supported families: {', '.join(FAMILIES)}")
    if spec in PRESETS:
        return preset_config(PRESETS[spec], family or DEFAULT_FAMILY, vocab_size, max_positions)
    gguf = gguf_files(spec)
    if gguf is not None:
        config = gguf_config(gguf)
        check_pretrained_config(config, spec, family, vocab_size, max_positions)
        return config
    path = Path(spec)
    if not path.exists():
        if path.suffix == ".json" or "/" in spec or "\\" in spec:
            raise FileNotFoundError(f"model config {spec} does not exist")
        raise ValueError(
            f"unknown model preset {spec!r}; presets: {', '.join(PRESETS)}; real models: {', '.join(NAMED_MODELS)}; "
            "a path to a config.json, a .gguf file or a local checkpoint folder is also accepted"
        )
    config = _read_config_file(path / "config.json" if path.is_dir() else path, family)
    if checkpoint_weights_folder(spec) is not None:
        _check_checkpoint_covers(config, path, vocab_size, max_positions)
    else:
        _apply_overrides(config, vocab_size, max_positions)
    return config


def preset_config(
    preset: ModelPreset, family: str, vocab_size: int | None, max_positions: int | None
) -> PretrainedConfig:
    """The config of `preset` in `family`, with no dropout (training runs must be reproducible).

    Special token ids are left unset: they belong to the tokenizer, which the caller knows and this
    function does not (the families' defaults, e.g. gpt2's 50256, lie outside small vocabularies).
    """
    vocab = vocab_size if vocab_size is not None else preset.vocab_size
    positions = max_positions if max_positions is not None else preset.max_positions
    if family == "gpt2":
        return GPT2Config(
            vocab_size=vocab, n_positions=positions, n_embd=preset.hidden, n_layer=preset.layers,
            n_head=preset.heads, n_inner=preset.intermediate,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_NO_SPECIAL_TOKENS,
        )  # fmt: skip
    common = dict(
        vocab_size=vocab, max_position_embeddings=positions, hidden_size=preset.hidden,
        num_hidden_layers=preset.layers, num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads, intermediate_size=preset.intermediate,
        tie_word_embeddings=False, use_cache=True, **_NO_SPECIAL_TOKENS,
    )  # fmt: skip
    if family == "mistral":
        # Full attention, like the other families: a sliding window would change results only past
        # 4096 tokens anyway, and disabling it keeps every attention backend on the same path.
        return MistralConfig(sliding_window=None, **common)
    return _CONFIG_CLASSES[family](**common)


def _read_config_file(file: Path, family: str | None) -> PretrainedConfig:
    if not file.is_file():
        raise FileNotFoundError(f"model config {file} does not exist")
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"model config {file} is not valid JSON: {error}") from error
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"model config {file} must be a JSON object with a 'model_type' field")
    model_type = values["model_type"]
    _check_family(model_type, family, file)
    return _CONFIG_CLASSES[model_type].from_dict(values)


def check_pretrained_config(
    config: PretrainedConfig, spec: str, family: str | None, vocab_size: int | None, max_positions: int | None
) -> None:
    """Raise ValueError unless the real model `spec` is of a supported `family` (when one is asked
    for) and covers `vocab_size` tokens and `max_positions` positions."""
    _check_family(config.model_type, family, spec)
    _check_checkpoint_covers(config, Path(spec), vocab_size, max_positions)


def _check_family(model_type: str, family: str | None, source: Path | str) -> None:
    if model_type not in FAMILIES:
        raise ValueError(
            f"model config {source} has model_type {model_type!r}; supported families: {', '.join(FAMILIES)}"
        )
    if family is not None and family != model_type:
        raise ValueError(f"model family {family!r} was requested but {source} describes a {model_type!r} model")


def _apply_overrides(config: PretrainedConfig, vocab_size: int | None, max_positions: int | None) -> None:
    if vocab_size is not None:
        config.vocab_size = vocab_size
    if max_positions is not None:
        config.max_position_embeddings = max_positions


def _check_checkpoint_covers(
    config: PretrainedConfig, folder: Path, vocab_size: int | None, max_positions: int | None
) -> None:
    if vocab_size is not None and config.vocab_size < vocab_size:
        raise ValueError(
            f"checkpoint {folder} has a vocabulary of {config.vocab_size} tokens, "
            f"smaller than the tokenizer's {vocab_size}"
        )
    if max_positions is not None and config.max_position_embeddings < max_positions:
        raise ValueError(
            f"checkpoint {folder} supports {config.max_position_embeddings} positions, "
            f"fewer than the requested {max_positions}"
        )
