"""Query and key stored in centred blocks along tokens (lazyzero/activations/by_channel.py)."""

import pytest
import torch

from lazyzero.activations.by_channel import ChannelBlocked, TokenLayout, quantize_by_channel
from lazyzero.ops.quant import dequantize_blockwise, quantize_blockwise

BATCH, HEADS, TOKENS, HEAD_DIM = 2, 4, 128, 32


def key_like(dtype=torch.float32, tokens=TOKENS) -> torch.Tensor:
    """[batch, heads, tokens, head_dim] with a few channels carrying large values that barely change
    from token to token, as pretrained models' keys do."""
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(BATCH, HEADS, tokens, HEAD_DIM, generator=generator)
    key[..., 3] += 80.0
    key[..., 17] -= 40.0
    return key.to(dtype)


def relative_error(restored: torch.Tensor, exact: torch.Tensor) -> float:
    return float((restored.double() - exact.double()).norm() / exact.double().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_constant_channels_cost_the_rest_nothing(dtype):
    """Blocks along the hidden dimension hold a large channel beside small ones and round the small
    ones to a few levels; blocks along tokens, centred, do not."""
    key = key_like(dtype)
    by_channel = quantize_by_channel(key, bits=8, block_size=64).materialize().view_as(key)
    along_hidden = dequantize_blockwise(quantize_blockwise(key, bits=8, block_size=64, keep_outliers=True))
    small = [c for c in range(HEAD_DIM) if c not in (3, 17)]
    error_by_channel = relative_error(by_channel[..., small], key[..., small])
    assert error_by_channel < 0.01
    assert error_by_channel < relative_error(along_hidden[..., small], key[..., small]) / 4


def test_storages_laid_out_tokens_by_heads_are_restored_in_place():
    """CPU SDPA saves a [batch, heads, tokens, head_dim] view of a [batch, tokens, heads x head_dim]
    storage: blocks run along its tokens, and the storage comes back in its own order."""
    key = key_like()
    storage = key.transpose(1, 2).contiguous()  # [batch, tokens, heads, head_dim]
    view = storage.transpose(1, 2)
    assert TokenLayout.of(view) == TokenLayout(BATCH, TOKENS, HEADS * HEAD_DIM)
    form = quantize_by_channel(view, bits=8, block_size=64)
    restored = form.materialize().view_as(storage)
    assert relative_error(restored, storage) < 0.01


@pytest.mark.parametrize("tokens", [100, 7])
def test_tokens_are_padded_to_whole_blocks(tokens):
    key = key_like(tokens=tokens)
    form = quantize_by_channel(key, bits=8, block_size=64)
    assert form.layout == TokenLayout(BATCH * HEADS, tokens, HEAD_DIM)
    assert relative_error(form.materialize().view_as(key), key) < 0.01
    padded = BATCH * HEADS * HEAD_DIM * 64 * -(-tokens // 64)
    assert form.nbytes == padded + padded // 64 * (4 + 4)  # int8 codes, an fp32 scale and centre per block


def test_the_saved_tensor_is_not_changed():
    key = key_like()
    before = key.clone()
    quantize_by_channel(key, bits=8, block_size=64)
    assert torch.equal(key, before)


def test_extreme_values_are_exact_once_centred():
    """The middle of the block's range as its centre puts both ends of the range on codes +-127."""
    key = key_like()
    restored = quantize_by_channel(key, bits=8, block_size=64).materialize().view_as(key)
    channel = key[0, 0, :64, 3]
    for index in (int(channel.argmax()), int(channel.argmin())):
        torch.testing.assert_close(restored[0, 0, index, 3], channel[index], rtol=1e-6, atol=1e-5)


def test_layouts_that_are_not_tokens_by_channels_are_refused():
    assert TokenLayout.of(torch.ones(64)) is None
    assert TokenLayout.of(torch.ones(8, 64)[2:]) is None  # not at the start of its storage
    # a dimension that steps across tokens without covering whole tokens x channels slabs
    assert TokenLayout.of(torch.ones(120).as_strided((3, 10, 4), (7, 4, 1))) is None
    # [tokens, batch, channels] viewed as [batch, tokens, channels]: tokens of batch x channels values
    assert TokenLayout.of(torch.ones(64, 2, 16).transpose(0, 1)) == TokenLayout(1, 64, 32)
    assert isinstance(quantize_by_channel(torch.ones(2, 64, 16), 8, 64), ChannelBlocked)
