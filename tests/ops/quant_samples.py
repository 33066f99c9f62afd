"""Sample inputs shared by the quant op tests (CPU kernels, CUDA kernels, public API)."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZE_OPS = ("quantize_int8", "quantize_int4")
OUTLIER_OPS = ("quantize_int8_outliers", "quantize_int4_outliers")


def sizes_around(block_size: int) -> list[int]:
    """Empty, one element, one block give or take one element, and a size that is a multiple of
    no block size used in the tests."""
    return [0, 1, block_size - 1, block_size, block_size + 1, 4097]


def varied_magnitudes(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Normal values whose magnitude jumps by powers of ten every 64 elements, so that the scales
    of neighbouring blocks differ by orders of magnitude (fp16-safe range: 1e-3 .. 1e3)."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-3, 4, (n // 64 + 1,), generator=generator)
    magnitude = (10.0**exponents).repeat_interleave(64)[:n]
    return (torch.randn(n, generator=generator) * magnitude).to(dtype)


def with_special_values(n: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of every kind: a NaN block (with an Inf too), a +Inf block, a -Inf block, an all-zero
    block, a block of subnormal-scale values, and ordinary blocks after them (n >= 5 blocks)."""
    x = varied_magnitudes(n, torch.float32, seed=1)
    blocks = x[: n // block_size * block_size].view(-1, block_size)
    blocks[0, 3] = float("nan")
    blocks[0, 5] = float("inf")
    blocks[1, 0] = float("inf")
    blocks[2, -1] = float("-inf")
    blocks[3] = 0.0
    blocks[4] = torch.linspace(-1e-38, 1e-38, block_size)
    return x.to(dtype)


def dequantize_sum_inputs(
    rows: int, n: int, block_size: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 codes [rows, n] and positive fp32 scales [rows, ceil(n / block_size)]."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, n), generator=generator, dtype=torch.int8)
    blocks = -(-n // block_size)
    scales = torch.rand(rows, blocks, generator=generator) * 10.0 ** torch.randint(
        -3, 3, (rows, blocks), generator=generator
    )
    return codes, scales


def with_outliers(n: int, block_size: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    """Normal values with a few elements thousands of times larger, as in the residual stream of a
    pretrained LLM: one in most blocks, two of equal magnitude in one block (the first is taken),
    and a block whose only large element is its last."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=generator)
    where = torch.randint(0, max(n, 1), (max(n // block_size, 1),), generator=generator)
    x[where[where < n]] = 3000.0
    if n >= 3 * block_size:
        x[block_size + 1] = x[block_size + 7] = -5000.0
        x[3 * block_size - 1] = 4000.0
    return x.to(dtype)


# (lead, tokens, channels, block_size): whole blocks, a padded last block, fewer tokens than a block,
# one token, one channel, channels that fill no whole task of the CPU kernel, no lead at all.
TOKEN_BLOCK_SHAPES = [(2, 128, 32, 64), (3, 100, 40, 64), (2, 7, 33, 64), (1, 1, 5, 64), (4, 65, 1, 2),
                      (1, 300, 70, 256), (0, 16, 8, 64)]


def key_like(lead: int, tokens: int, channels: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """lead x tokens x channels values, flat, whose channels have offsets of their own (as keys do)."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randn(channels, generator=generator) * 30
    return (torch.randn(lead, tokens, channels, generator=generator) + offsets).to(dtype).reshape(-1)


def with_non_finite(x: torch.Tensor, channels: int) -> torch.Tensor:
    """x (lead x tokens x channels, flat) with a NaN, a +Inf and a -Inf, and channel 1 holding both
    infinities in tokens 2 and 3 (one block)."""
    x = x.clone()
    spots = ((5, "nan"), (40, "inf"), (77, "-inf"), (2 * channels + 1, "inf"), (3 * channels + 1, "-inf"))
    for index, value in spots:
        if index < x.numel():
            x[index] = float(value)
    return x
