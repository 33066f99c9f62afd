"""Build randomly initialized (or locally saved, or real pretrained) causal LMs from `model_config` specs."""

from __future__ import annotations

import contextlib

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lazyzero.models.config import check_pretrained_config, model_config
from lazyzero.models.pretrained import checkpoint_weights_folder, gguf_files, load_gguf_model

# SDPA: deterministic on CPU, the default fast path on GPU, and it needs no extra package.
ATTENTION_IMPLEMENTATION = "sdpa"


def build_model(
    spec: str,
    family: str | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_positions: int | None = None,
    meta: bool = False,
    zero_init_config: dict | None = None,
) -> PreTrainedModel:
    """A causal LM for `spec` (see `model_config`).

    Presets and config files get a fresh initialization drawn from `seed` (the global RNG state is
    left untouched). A checkpoint folder with weights, a GGUF file or a named real model is loaded
    with from_pretrained, from the local disk only. `meta=True` builds on the meta device: shapes
    without memory, for planning.

    `zero_init_config` (a DeepSpeed config with ZeRO stage 3, under torch.distributed): every
    parameter is partitioned across the ranks as it is created, through transformers' own ZeRO-3
    path (`HfDeepSpeedConfig`: `deepspeed.zero.Init`, initialization and checkpoint loading one
    module at a time), so that no rank holds the whole model (docs/plan.md, "Planning partitioned
    models"). A GGUF file is read whole whatever this says: transformers dequantizes it in memory.
    """
    gguf = gguf_files(spec)
    if gguf is not None and not meta:
        # Checked on the loaded model's config: reading it from the file alone parses the whole GGUF
        # metadata a second time, as long as the load itself.
        model = load_gguf_model(gguf, dtype, ATTENTION_IMPLEMENTATION)
        check_pretrained_config(model.config, spec, family, vocab_size, max_positions)
        return model
    config = model_config(spec, family=family, vocab_size=vocab_size, max_positions=max_positions)
    folder = checkpoint_weights_folder(spec)
    partitioned = _partitioned_by(zero_init_config) if not meta else contextlib.nullcontext()
    if folder is not None and not meta:
        with partitioned:
            return AutoModelForCausalLM.from_pretrained(
                str(folder), config=config, local_files_only=True, dtype=dtype,
                attn_implementation=ATTENTION_IMPLEMENTATION,
            )
    device = torch.device("meta") if meta else contextlib.nullcontext()
    with torch.random.fork_rng(devices=[]), device, partitioned:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_IMPLEMENTATION)


@contextlib.contextmanager
def _partitioned_by(ds_config: dict | None):
    """While active, transformers builds and loads models under ZeRO-3 partitioning for `ds_config`.

    transformers' own path rather than a bare `with deepspeed.zero.Init()`: that one computes the
    rotary frequencies in the training dtype (zero.Init casts what `torch.arange` returns), and skips
    the model's weight initialization (parameters are empty by then); transformers guards the first
    and gathers each module for the second. Only for this build: the setting is process-wide."""
    if ds_config is None:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    settings = HfDeepSpeedConfig(ds_config)  # noqa: F841 - held: transformers keeps only a weak reference
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
