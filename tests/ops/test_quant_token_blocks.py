"""Centred blocks along tokens: C++ CPU kernels against the PyTorch reference, bit for bit, and the
reference against the transposed-copy pipeline it replaced."""

import pytest
import torch
import torch.nn.functional as F
from quant_samples import DTYPES, TOKEN_BLOCK_SHAPES, key_like, with_non_finite

import lazyzero.ops.quant  # noqa: F401  (defines the torch.ops.lazyzero schemas)
from lazyzero.ops import quant_reference
from lazyzero.ops.quant import NativeCalls, quantize_token_blocks, restore_token_blocks
from lazyzero.testing import assert_close

pytestmark = pytest.mark.usefixtures("native_cpu")
ops = torch.ops.lazyzero
SEED = 20240601
def assert_matches_reference(x, tokens, channels, bits, block_size, stochastic):
    found = ops.quantize_token_blocks(x, tokens, channels, bits, block_size, stochastic, SEED)
    expected = quant_reference.quantize_token_blocks(x, tokens, channels, bits, block_size, stochastic, SEED)
    for got, want in zip(found, expected):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(got, want, "native_vs_reference")
    restored = ops.restore_token_blocks(*found, tokens, channels, bits, block_size)
    assert restored.dtype == x.dtype and restored.shape == (x.numel(),)
    expected_restored = quant_reference.restore_token_blocks(*expected, tokens, channels, bits, block_size)
    assert_close(restored, expected_restored, "native_vs_reference")
    return found, restored


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_blocks_match_reference(dtype, bits, stochastic):
    for lead, tokens, channels, block_size in TOKEN_BLOCK_SHAPES:
        x = key_like(lead, tokens, channels, dtype)
        assert_matches_reference(x, tokens, channels, bits, block_size, stochastic)
        assert_matches_reference(with_non_finite(x, channels), tokens, channels, bits, block_size, stochastic)


def test_zero_blocks_and_constant_channels_come_back_exact():
    x = key_like(2, 100, 8, torch.float32)
    x.view(2, 100, 8)[:, :, 3] = 0.0
    x.view(2, 100, 8)[:, :, 5] = 7.25
    (codes, scales, centres), restored = assert_matches_reference(x, 100, 8, 8, 64, False)
    assert torch.equal(restored.view(2, 100, 8)[:, :, [3, 5]], x.view(2, 100, 8)[:, :, [3, 5]])


def test_non_finite_blocks_stay_non_finite():
    x = with_non_finite(key_like(2, 128, 32, torch.float32), 32)
    (_, scales, _), restored = assert_matches_reference(x, 128, 32, 8, 64, False)
    assert not torch.isfinite(scales).all()
    assert not restored[[5, 40, 77]].isfinite().any()


def test_reference_is_the_transposed_copy_pipeline_in_fp32():
    """For fp32 the reference computes what lazyzero/activations/by_channel.py did with a transposed,
    padded copy: aminmax, the centre, its subtraction, then quantize_int8 of the copy."""
    lead, tokens, channels, block_size = 3, 100, 40, 64
    x = key_like(lead, tokens, channels, torch.float32)
    copy = F.pad(x.view(lead, tokens, channels).transpose(1, 2), (0, -tokens % block_size), mode="replicate")
    blocks = copy.reshape(-1, block_size)
    low, high = torch.aminmax(blocks, dim=1)
    centres = (low + high) / 2
    codes, scales = quant_reference.quantize_int8(blocks - centres[:, None], block_size, True, SEED)
    found = quant_reference.quantize_token_blocks(x, tokens, channels, 8, block_size, True, SEED)
    for got, want in zip(found, (codes, scales, centres)):
        assert_close(got, want, "native_vs_reference")


def test_non_contiguous_input_is_read_in_its_logical_order():
    x = key_like(1, 64, 64, torch.float32).view(64, 64).t()
    assert not x.is_contiguous()
    assert_matches_reference(x, 64, 64, 8, 64, False)


def test_public_api_is_one_call_each_way():
    x = key_like(2, 100, 24, torch.bfloat16)
    with NativeCalls() as calls:
        codes, centres = quantize_token_blocks(x, 100, 24, bits=4, block_size=64)
        restored = restore_token_blocks(codes, centres, 100, 24)
    assert calls.counts == {"quantize_token_blocks": 1, "restore_token_blocks": 1}
    assert codes.shape == torch.Size([2 * 24 * 128]) and codes.dtype == torch.float32 and centres.dtype == x.dtype
    expected = quant_reference.restore_token_blocks(
        *quant_reference.quantize_token_blocks(x, 100, 24, 4, 64, False, 0), 100, 24, 4, 64)
    assert_close(restored, expected, "native_vs_reference")


BAD_CALLS = {
    "layout": (lambda: ops.quantize_token_blocks(torch.ones(100), 7, 3, 8, 64, False, 0), "not lead x 7 tokens"),
    "bits": (lambda: ops.quantize_token_blocks(torch.ones(64), 8, 8, 2, 64, False, 0), "bits must be 8 or 4"),
    "odd-int4-block": (lambda: ops.quantize_token_blocks(torch.ones(64), 8, 8, 4, 3, False, 0), "must be even"),
    "double": (lambda: ops.quantize_token_blocks(torch.ones(64, dtype=torch.float64), 8, 8, 8, 4, False, 0),
               "float32, bfloat16 or float16"),
    "restore-codes": (lambda: ops.restore_token_blocks(torch.ones(64, dtype=torch.int8), torch.ones(2),
                                                       torch.ones(2), 8, 2, 8, 64), "codes must have 128"),
    "restore-centres": (lambda: ops.restore_token_blocks(torch.ones(128, dtype=torch.int8), torch.ones(2),
                                                         torch.ones(3), 8, 2, 8, 64), "centres must have 2"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_kernels_reject_bad_arguments(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(RuntimeError, match=message):
        call()
