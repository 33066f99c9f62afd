"""The public quantization API: error bounds, zero and NaN/Inf blocks, stochastic rounding,
argument checks. Runs the native kernels where they build, else the reference."""

import pytest
import torch
from quant_samples import DTYPES, varied_magnitudes, with_special_values

from lazyzero.ops import dequantize_blockwise, dequantize_sum_int8, quantize_blockwise
from lazyzero.ops.quant_reference import INT4_MAX, INT8_MAX
from lazyzero.testing import TOLERANCES

QMAX = {8: INT8_MAX, 4: INT4_MAX}


def per_element_scale(q) -> torch.Tensor:
    return q.scales.repeat_interleave(q.block_size)[: q.numel].view(q.shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_round_to_nearest_error_is_at_most_half_a_step(bits, dtype):
    x = varied_magnitudes(3 * 4096 + 17, dtype).view(-1, 1)
    q = quantize_blockwise(x, bits=bits, block_size=256)
    restored = dequantize_blockwise(q, torch.float32)
    error = (restored.double() - x.double()).abs()
    bound = per_element_scale(q).double() * TOLERANCES["quant_round_trip_steps"]["atol"]
    assert (error <= bound).all()
    # Scales are absmax / qmax, i.e. the bound is absmax / (2 * qmax) up to fp32 rounding.
    absmax = x.float().view(-1)[: q.numel // 256 * 256].view(-1, 256).abs().amax(dim=1)
    assert torch.equal(q.scales[: absmax.numel()], absmax / QMAX[bits])


@pytest.mark.parametrize("bits", [8, 4])
def test_ties_round_to_even(bits):
    qmax = QMAX[bits]
    x = torch.tensor([qmax, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -3.5])  # absmax = qmax: scale = 1
    q = quantize_blockwise(x, bits=bits, block_size=8)
    assert q.scales.tolist() == [1.0]
    assert dequantize_blockwise(q).tolist() == [qmax, 0, 2, 2, 0, -2, 4, -4]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [8, 4])
def test_zero_and_underflowing_blocks_dequantize_to_exact_zero(bits, stochastic):
    x = torch.zeros(3 * 64)
    x[64] = -0.0
    x[128:] = 1e-45  # the smallest subnormal: absmax / qmax underflows to a zero scale
    q = quantize_blockwise(x, bits=bits, block_size=64, stochastic=stochastic)
    assert q.scales.tolist() == [0.0, 0.0, 0.0]
    assert torch.equal(dequantize_blockwise(q), torch.zeros(3 * 64))


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [8, 4])
def test_nan_and_inf_never_become_finite(bits, dtype, stochastic):
    x = with_special_values(8 * 64 + 3, 64, dtype)
    q = quantize_blockwise(x, bits=bits, block_size=64, stochastic=stochastic)
    restored = dequantize_blockwise(q, torch.float32)[:512].view(8, 64)
    assert q.scales[0].isnan() and restored[0].isnan().all()
    assert q.scales[1].item() == q.scales[2].item() == float("inf")
    assert not restored[1:3].isfinite().any()
    assert restored[1, 0] == float("inf") and restored[2, -1] == float("-inf")
    assert restored[3:].isfinite().all()
    assert not dequantize_blockwise(q).isfinite()[~x.isfinite()].any()


def test_stochastic_rounding_is_unbiased():
    """Mean of R stochastic round trips vs x, in code steps, over N elements.

    Each trial rounds v = x / scale to floor(v) or floor(v) + 1 with error of mean 0 and standard
    deviation <= 1/2, so the mean error over N * R independent draws has sigma <= 1/(2 sqrt(N R))
    (1e-3 here); 6 sigma is allowed. Every draw is floor(v) or floor(v) + 1, so each error is
    below one step.
    """
    n, trials = 1024, 256
    x = varied_magnitudes(n, seed=5)
    steps = []
    for seed in range(trials):
        q = quantize_blockwise(x, bits=8, block_size=128, stochastic=True, seed=seed)
        scale = per_element_scale(q).double()
        steps.append((dequantize_blockwise(q).double() - x.double()) / scale)
    errors = torch.stack(steps)
    assert (errors.abs() < 1).all()
    sigma = 1 / (2 * (n * trials) ** 0.5)
    assert abs(errors.mean().item()) < 6 * sigma
    # Per element, the mean over trials approaches x: sigma <= 1/(2 sqrt(R)) = 1/32 per element.
    assert (errors.mean(dim=0).abs() < 6 / 32).all()


def test_stochastic_rounding_is_reproducible_per_seed():
    x = varied_magnitudes(5000)
    first = quantize_blockwise(x, stochastic=True, seed=11)
    again = quantize_blockwise(x, stochastic=True, seed=11)
    other = quantize_blockwise(x, stochastic=True, seed=12)
    assert torch.equal(first.codes, again.codes)
    assert (first.codes != other.codes).any()


@pytest.mark.parametrize("bits", [8, 4])
def test_shape_and_dtype_are_restored(bits):
    x = varied_magnitudes(6 * 7 * 11, torch.bfloat16).view(6, 7, 11)
    q = quantize_blockwise(x, bits=bits, block_size=32)
    assert q.codes.numel() == (x.numel() if bits == 8 else (x.numel() + 1) // 2)
    assert dequantize_blockwise(q).shape == x.shape
    assert dequantize_blockwise(q).dtype == torch.bfloat16
    assert dequantize_blockwise(q, torch.float16).dtype == torch.float16


def test_quantize_and_dequantize_into_preallocated_buffers():
    x = varied_magnitudes(3000, torch.float16)
    codes, scales = torch.empty(3000, dtype=torch.int8), torch.empty(12)
    q = quantize_blockwise(x, out=(codes, scales), stochastic=True, seed=3)
    assert q.codes is codes and q.scales is scales
    expected = quantize_blockwise(x, stochastic=True, seed=3)
    assert torch.equal(codes, expected.codes) and torch.equal(scales, expected.scales)
    out = torch.empty(3000, dtype=torch.bfloat16)
    assert dequantize_blockwise(q, out=out) is out
    assert torch.equal(out, dequantize_blockwise(expected, torch.bfloat16))


def test_meta_tensors_give_shapes_without_data():
    q = quantize_blockwise(torch.empty(1001, device="meta"), bits=4, block_size=100)
    assert q.codes.shape == (501,) and q.scales.shape == (11,)
    assert dequantize_blockwise(q).shape == (1001,)


def test_dequantize_sum_writes_into_out():
    x = varied_magnitudes(4 * 1000).view(4, 1000)
    parts = [quantize_blockwise(row, block_size=64) for row in x]
    codes = torch.stack([p.codes for p in parts])
    scales = torch.stack([p.scales for p in parts])
    out = torch.empty(1000)
    assert dequantize_sum_int8(codes, scales, 64, alpha=0.25, out=out) is out
    assert torch.equal(out, dequantize_sum_int8(codes, scales, 64, alpha=0.25))
    mean = torch.stack([dequantize_blockwise(p) for p in parts]).mean(dim=0)
    torch.testing.assert_close(out, mean, rtol=1e-5, atol=1e-6)


BAD_QUANTIZE_ARGS = {
    "bits": (dict(bits=3), ValueError, "bits must be one of"),
    "zero-block": (dict(block_size=0), ValueError, "positive int"),
    "float-block": (dict(block_size=64.0), ValueError, "positive int"),
    "odd-int4-block": (dict(bits=4, block_size=63), ValueError, "even"),
    "seed-range": (dict(seed=2**63), ValueError, "int64"),
}


@pytest.mark.parametrize("case", BAD_QUANTIZE_ARGS)
def test_quantize_rejects_bad_arguments(case):
    kwargs, error, message = BAD_QUANTIZE_ARGS[case]
    with pytest.raises(error, match=message):
        quantize_blockwise(torch.ones(128), **kwargs)


def test_quantize_rejects_unsupported_dtypes():
    for dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match="x.dtype must be one of"):
            quantize_blockwise(torch.ones(8, dtype=dtype))


def test_out_buffers_are_checked():
    x = torch.ones(100)
    with pytest.raises(ValueError, match="out scales must be a contiguous torch.float32 tensor"):
        quantize_blockwise(x, out=(torch.empty(100, dtype=torch.int8), torch.empty(2)))
    with pytest.raises(ValueError, match="bits=8 only"):
        quantize_blockwise(x, bits=4, out=(torch.empty(50, dtype=torch.uint8), torch.empty(1)))
    q = quantize_blockwise(x)
    with pytest.raises(ValueError, match="contradicts"):
        dequantize_blockwise(q, torch.float16, out=torch.empty(100))


def test_dequantize_sum_rejects_mismatched_shapes():
    codes = torch.zeros(2, 100, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"scales must be float32 \[2, 2\]"):
        dequantize_sum_int8(codes, torch.ones(2, 3), 64)
    with pytest.raises(ValueError, match="codes must be int8"):
        dequantize_sum_int8(codes.view(-1), torch.ones(4), 64)
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor of 100"):
        dequantize_sum_int8(codes, torch.ones(2, 2), 64, out=torch.empty(99))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_outliers_are_exact_and_do_not_coarsen_their_block(bits, dtype):
    """A value thousands of times larger than its block comes back exact, and the rest of the block
    is quantized as if it were not there (the error the same as for the block without it)."""
    x = torch.randn(64 * 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    x_big = x.clone()
    x_big[::64] = 5000.0
    q = quantize_blockwise(x_big, bits=bits, block_size=64, keep_outliers=True)
    restored = dequantize_blockwise(q)
    assert torch.equal(restored[::64], x_big[::64])
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[::64] = False
    without = x.clone()
    without[::64] = 0
    plain = dequantize_blockwise(quantize_blockwise(without, bits=bits, block_size=64))
    assert torch.equal(restored[rest], plain[rest])
    coarse = dequantize_blockwise(quantize_blockwise(x_big, bits=bits, block_size=64))
    assert (coarse[rest].float() - x[rest].float()).norm() > 5 * (restored[rest].float() - x[rest].float()).norm()
    code_bytes = 64 * 100 * bits // 8
    # codes, then per block: an fp32 scale, the value in the tensor's own dtype, a one-byte index
    assert q.nbytes == code_bytes + 100 * (4 + dtype.itemsize + 1)
    assert q.outlier_values.dtype == dtype


def test_kept_outliers_need_a_block_of_at_most_256():
    with pytest.raises(ValueError, match="at most 256"):
        quantize_blockwise(torch.ones(2048), bits=8, block_size=512, keep_outliers=True)
