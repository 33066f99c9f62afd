"""Centred blocks along tokens: CUDA kernels against the PyTorch reference (computed on the CPU), bit
for bit. Marked `gpu`: skipped on machines without a CUDA device."""

import pytest
import torch
from quant_samples import DTYPES, TOKEN_BLOCK_SHAPES, key_like, with_non_finite

import lazyzero.ops.quant  # noqa: F401  (defines the torch.ops.lazyzero schemas)
from lazyzero.ops import native_build, quant_reference
from lazyzero.testing import assert_close

pytestmark = pytest.mark.gpu
ops = torch.ops.lazyzero
SEED = 20240601
# More blocks than one grid of warps (4096 CTAs x 8 warps), so the grid-stride loops go round.
LARGE_SHAPE = (3, 2048, 512, 64)


@pytest.fixture(scope="module", autouse=True)
def native_cuda():
    assert native_build.ensure_native("cuda")


def assert_cuda_matches_reference(x, tokens, channels, bits, block_size, stochastic):
    found = ops.quantize_token_blocks(x.cuda(), tokens, channels, bits, block_size, stochastic, SEED)
    expected = quant_reference.quantize_token_blocks(x, tokens, channels, bits, block_size, stochastic, SEED)
    for got, want in zip(found, expected):
        assert got.is_cuda and got.dtype == want.dtype
        assert_close(got.cpu(), want, "native_vs_reference")
    restored = ops.restore_token_blocks(*found, tokens, channels, bits, block_size)
    expected_restored = quant_reference.restore_token_blocks(*expected, tokens, channels, bits, block_size)
    assert_close(restored.cpu(), expected_restored, "native_vs_reference")


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_token_blocks_match_reference(dtype, bits, stochastic):
    for lead, tokens, channels, block_size in TOKEN_BLOCK_SHAPES:
        x = key_like(lead, tokens, channels, dtype)
        assert_cuda_matches_reference(x, tokens, channels, bits, block_size, stochastic)
        assert_cuda_matches_reference(with_non_finite(x, channels), tokens, channels, bits, block_size, stochastic)


@pytest.mark.parametrize("bits", [8, 4])
def test_grid_stride_loops_cover_a_large_storage(bits):
    lead, tokens, channels, block_size = LARGE_SHAPE
    x = key_like(lead, tokens, channels, torch.bfloat16)
    assert_cuda_matches_reference(x, tokens, channels, bits, block_size, stochastic=True)


def test_cuda_restores_what_the_cpu_kernel_stored():
    x = key_like(2, 100, 40, torch.bfloat16)
    stored = ops.quantize_token_blocks(x, 100, 40, 8, 64, False, 0)
    restored = ops.restore_token_blocks(*(part.cuda() for part in stored), 100, 40, 8, 64)
    assert_close(restored.cpu(), ops.restore_token_blocks(*stored, 100, 40, 8, 64), "native_vs_reference")
