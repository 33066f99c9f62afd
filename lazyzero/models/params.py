"""Analytic parameter counts of the supported families, from the config alone (no weights).

The planner sizes 7B-27B models with this, so it must not allocate anything. tests/app/test_models.py
checks it against sum(p.numel()) of built models in every family.
"""

from __future__ import annotations

from transformers import PretrainedConfig


def count_parameters(config: PretrainedConfig) -> int:
    """Number of trainable parameters of AutoModelForCausalLM.from_config(config).

    Tied input/output embeddings count once, as in `model.parameters()`.
    """
    counters = {"llama": _llama_like, "mistral": _llama_like, "qwen2": _llama_like, "gpt2": _gpt2}
    if config.model_type not in counters:
        raise ValueError(f"cannot count parameters of model_type {config.model_type!r}; supported: {sorted(counters)}")
    vocab, hidden = config.vocab_size, config.hidden_size
    body = counters[config.model_type](config)
    embeddings = vocab * hidden * (1 if config.tie_word_embeddings else 2)
    return embeddings + body


def _llama_like(config: PretrainedConfig) -> int:
    """Decoder layers + final RMSNorm of llama, mistral and qwen2 (gated MLP, RMSNorm, rotary positions)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_width = config.num_attention_heads * head_dim
    kv_width = config.num_key_value_heads * head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if config.model_type == "qwen2":
        # Qwen2 has biases on the q/k/v projections only.
        attention += q_width + 2 * kv_width
    elif getattr(config, "attention_bias", False):
        attention += q_width + 2 * kv_width + hidden
    mlp = 3 * hidden * inner
    if getattr(config, "mlp_bias", False):
        mlp += 2 * inner + hidden
    norms = 2 * hidden
    return config.num_hidden_layers * (attention + mlp + norms) + hidden


def _gpt2(config: PretrainedConfig) -> int:
    """Learned positions + GPT-2 blocks (biased Conv1D projections, LayerNorm with bias) + final LayerNorm."""
    hidden = config.hidden_size
    inner = config.n_inner if config.n_inner is not None else 4 * hidden
    attention = hidden * 3 * hidden + 3 * hidden + hidden * hidden + hidden
    mlp = hidden * inner + inner + inner * hidden + hidden
    norms = 2 * 2 * hidden
    positions = config.max_position_embeddings * hidden
    return positions + config.num_hidden_layers * (attention + mlp + norms) + 2 * hidden
