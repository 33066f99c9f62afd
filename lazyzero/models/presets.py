"""Named model sizes shipped with lazyzero, independent of the model family.

The same `ModelPreset` dims map onto every supported family (see `lazyzero.models.config`). `tiny`
and `demo` use the byte-level vocabulary of `ByteTokenizer`; the larger presets use the 32000-token
vocabulary of Llama-2 style tokenizers so that their parameter counts match their names
(asserted in tests/app/test_models.py with the llama family, which has untied embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

from lazyzero.models.byte_vocabulary import BYTE_VOCAB_SIZE

SUBWORD_VOCAB_SIZE = 32000


@dataclass(frozen=True)
class ModelPreset:
    """Transformer dimensions shared by all families.

    `kv_heads` < `heads` means grouped-query attention (ignored by gpt2, which has none);
    `intermediate` is the MLP width (gated MLP for llama-like families, plain MLP for gpt2).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_size: int
    max_positions: int


PRESETS: dict[str, ModelPreset] = {
    # About 0.13M parameters: fast enough on CPU to build, train and decode inside unit tests.
    # kv_heads < heads so the tests exercise grouped-query attention.
    "tiny": ModelPreset(64, 2, 4, 2, 176, BYTE_VOCAB_SIZE, 256),
    # About 19M parameters: the CPU demo (trains on 2 cores at a useful speed).
    "demo": ModelPreset(512, 6, 8, 8, 1376, BYTE_VOCAB_SIZE, 512),
    # GPT-3 Small / Pythia-160M shapes with a gated MLP.
    "125m": ModelPreset(768, 12, 12, 12, 2048, SUBWORD_VOCAB_SIZE, 2048),
    # TinyLlama-like depth and widths, with full multi-head attention.
    "1b": ModelPreset(2048, 18, 16, 16, 5504, SUBWORD_VOCAB_SIZE, 2048),
    # Llama-2 7B and 13B shapes.
    "7b": ModelPreset(4096, 32, 32, 32, 11008, SUBWORD_VOCAB_SIZE, 4096),
    "13b": ModelPreset(5120, 40, 40, 40, 13824, SUBWORD_VOCAB_SIZE, 4096),
    # LLaMA-1 33B widths (head dim 128) with 50 layers instead of 60, which lands near 27B.
    "27b": ModelPreset(6656, 50, 52, 52, 17920, SUBWORD_VOCAB_SIZE, 4096),
}
