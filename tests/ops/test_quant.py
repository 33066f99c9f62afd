"""C++ CPU kernels against the PyTorch reference: bit for bit on codes, scales and outputs."""

import pytest
import torch
from quant_samples import (
    DTYPES,
    OUTLIER_OPS,
    QUANTIZE_OPS,
    dequantize_sum_inputs,
    sizes_around,
    varied_magnitudes,
    with_outliers,
    with_special_values,
)

import lazyzero.ops.quant  # noqa: F401  (defines the torch.ops.lazyzero schemas)
from lazyzero.ops import quant_reference
from lazyzero.testing import assert_close

pytestmark = pytest.mark.usefixtures("native_cpu")
ops = torch.ops.lazyzero
BLOCK_SIZES = (64, 256, 4096)
SEED = 20240601


def assert_quantize_matches_reference(op_name, x, block_size, stochastic, seed=SEED):
    codes, scales = getattr(ops, op_name)(x, block_size, stochastic, seed)
    ref_codes, ref_scales = getattr(quant_reference, op_name)(x, block_size, stochastic, seed)
    assert codes.dtype == ref_codes.dtype and scales.dtype == torch.float32
    assert_close(codes, ref_codes, "native_vs_reference")
    assert_close(scales, ref_scales, "native_vs_reference")
    return codes, scales


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", QUANTIZE_OPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_quantize_matches_reference_around_block_edges(op_name, dtype, block_size, stochastic):
    for n in sizes_around(block_size):
        x = varied_magnitudes(n, dtype)
        assert_quantize_matches_reference(op_name, x, block_size, stochastic)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", QUANTIZE_OPS)
def test_quantize_matches_reference_on_a_million_elements(op_name, dtype, stochastic):
    x = varied_magnitudes(2**20, dtype, seed=3)
    assert_quantize_matches_reference(op_name, x, 256, stochastic)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_quantize_int8_into_matches_reference(stochastic):
    for x in (varied_magnitudes(0), with_special_values(2**16 + 9, 256, torch.bfloat16)):
        codes = torch.full((x.numel(),), 55, dtype=torch.int8)
        scales = torch.full((-(-x.numel() // 256),), 5.0)
        ops.quantize_int8_into(x, 256, stochastic, SEED, codes, scales)
        ref_codes, ref_scales = quant_reference.quantize_int8(x, 256, stochastic, SEED)
        assert_close(codes, ref_codes, "native_vs_reference")
        assert_close(scales, ref_scales, "native_vs_reference")


def test_quantize_int8_matches_reference_with_odd_block_size():
    assert_quantize_matches_reference("quantize_int8", varied_magnitudes(1000), 7, False)
    assert_quantize_matches_reference("quantize_int8", varied_magnitudes(1000), 7, True)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", QUANTIZE_OPS)
def test_quantize_matches_reference_on_zero_nan_inf_blocks(op_name, dtype, stochastic):
    x = with_special_values(8 * 64, 64, dtype)
    codes, scales = assert_quantize_matches_reference(op_name, x, 64, stochastic)
    assert scales[0].isnan() and scales[1] == float("inf") and scales[2] == float("inf")
    assert scales[3] == 0


def assert_outliers_match_reference(op_name, x, block_size, stochastic, seed=SEED):
    actual = getattr(ops, op_name)(x, block_size, stochastic, seed)
    expected = getattr(quant_reference, op_name)(x, block_size, stochastic, seed)
    for got, want in zip(actual, expected):
        assert got.dtype == want.dtype
        assert_close(got, want, "native_vs_reference")
    return actual


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", OUTLIER_OPS)
@pytest.mark.parametrize("block_size", [2, 64, 256])
def test_quantize_with_outliers_matches_reference(op_name, dtype, block_size, stochastic):
    for n in sizes_around(block_size) + [2**18 + 3]:
        assert_outliers_match_reference(op_name, with_outliers(n, block_size, dtype), block_size, stochastic)
    assert_outliers_match_reference(op_name, with_special_values(8 * 64, 64, dtype), 64, stochastic)


@pytest.mark.parametrize("op_name", OUTLIER_OPS)
def test_the_first_of_tied_outliers_is_taken(op_name):
    """Equal magnitudes of either sign tie; the first is the outlier (the kernels search for the
    maximum and its position in two passes, the reference in one)."""
    x = torch.linspace(-1, 1, 3 * 64)
    x[[3, 40]] = torch.tensor([-5.0, 5.0])  # block 0: the negative one first
    x[[64 + 10, 64 + 63]] = 7.0  # block 1: equal values
    x[128:] = 2.0  # block 2: every element ties
    _, _, values, index = assert_outliers_match_reference(op_name, x, 64, False)
    assert index.tolist() == [3, 10, 0] and values.tolist() == [-5.0, 7.0, 2.0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_restore_block_outliers_matches_reference(dtype):
    x = with_outliers(4097, 64, torch.float32)
    codes, scales, values, index = quant_reference.quantize_int8_outliers(x, 64, False, 0)
    out = quant_reference.dequantize_int8(codes, scales, 64, dtype)
    expected = out.clone()
    ops.restore_block_outliers_(out, values, index, 64)
    quant_reference.restore_block_outliers_(expected, values, index, 64)
    assert_close(out, expected, "native_vs_reference")


def test_quantize_accepts_non_contiguous_input():
    x = varied_magnitudes(4096).view(64, 64).t()
    assert not x.is_contiguous()
    assert_quantize_matches_reference("quantize_int8", x, 256, False)


def test_stochastic_codes_depend_on_the_seed():
    x = varied_magnitudes(4096)
    first, _ = ops.quantize_int8(x, 256, True, 1)
    second, _ = ops.quantize_int8(x, 256, True, 2)
    again, _ = ops.quantize_int8(x, 256, True, 1)
    assert torch.equal(first, again)
    # About half the elements round the other way; 10% is far below that and far above chance.
    assert (first != second).float().mean() > 0.1


def dequantize_inputs(block_size: int) -> list[torch.Tensor]:
    """Inputs around the block edges, and a large one with zero, NaN and Inf blocks."""
    around = [varied_magnitudes(n) for n in sizes_around(block_size)]
    return around + [with_special_values(2**20 + 1, block_size, torch.float32)]


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [64, 256])
def test_dequantize_int8_matches_reference(block_size, out_dtype):
    for x in dequantize_inputs(block_size):
        codes, scales = ops.quantize_int8(x, block_size, False, 0)
        expected = quant_reference.dequantize_int8(codes, scales, block_size, out_dtype)
        actual = ops.dequantize_int8(codes, scales, block_size, out_dtype)
        assert_close(actual, expected, "native_vs_reference")
        into = torch.full_like(expected, 3.0)
        ops.dequantize_int8_into(codes, scales, block_size, into)
        assert_close(into, expected, "native_vs_reference")


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [64, 256])
def test_dequantize_int4_matches_reference(block_size, out_dtype):
    for x in dequantize_inputs(block_size):
        packed, scales = ops.quantize_int4(x, block_size, False, 0)
        expected = quant_reference.dequantize_int4(packed, scales, x.numel(), block_size, out_dtype)
        actual = ops.dequantize_int4(packed, scales, x.numel(), block_size, out_dtype)
        assert_close(actual, expected, "native_vs_reference")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_dequantize_sum_matches_reference(rows):
    cases = [(0, 64, 1.0), (1, 64, 0.5), (4097, 256, 1 / 3), (2**18 + 5, 256, 0.25)]
    for n, block_size, alpha in cases:
        codes, scales = dequantize_sum_inputs(rows, n, block_size, seed=rows)
        expected = quant_reference.dequantize_sum_int8(codes, scales, block_size, alpha)
        actual = ops.dequantize_sum_int8(codes, scales, block_size, alpha)
        assert_close(actual, expected, "native_vs_reference")
        out = torch.full((n,), 7.0)
        ops.dequantize_sum_int8_into(codes, scales, block_size, alpha, out)
        assert_close(out, expected, "native_vs_reference")


def test_dequantize_sum_propagates_non_finite_scales():
    codes, scales = dequantize_sum_inputs(3, 300, 64)
    scales[1, 0] = float("nan")
    scales[2, 2] = float("inf")
    codes[2, 128:192] = 0
    result = ops.dequantize_sum_int8(codes, scales, 64, 1.0)
    expected = quant_reference.dequantize_sum_int8(codes, scales, 64, 1.0)
    assert_close(result, expected, "native_vs_reference")
    assert result[:64].isnan().all()
    assert not result[128:192].isfinite().any()
    assert result[64:128].isfinite().all()


INT8_CODES = torch.ones(8, dtype=torch.int8)
BAD_CALLS = {
    "odd-int4-block": (lambda: ops.quantize_int4(torch.ones(8), 3, False, 0), "must be even"),
    "zero-block": (lambda: ops.quantize_int8(torch.ones(8), 0, False, 0), "must be positive"),
    "double-input": (
        lambda: ops.quantize_int8(torch.ones(8, dtype=torch.float64), 4, False, 0),
        "float32, bfloat16 or float16",
    ),
    "scales-count": (
        lambda: ops.dequantize_int8(INT8_CODES, torch.ones(3), 4, torch.float32),
        "scales must have 2 elements",
    ),
    "packed-count": (
        lambda: ops.dequantize_int4(INT8_CODES.view(torch.uint8), torch.ones(2), 9, 8, torch.half),
        "packed must have 5 elements",
    ),
    "into-codes-dtype": (
        lambda: ops.quantize_int8_into(torch.ones(8), 4, False, 0, torch.ones(8), torch.ones(2)),
        "codes must have dtype Char",
    ),
    "into-out-contiguous": (
        lambda: ops.dequantize_int8_into(INT8_CODES, torch.ones(2), 4, torch.ones(8, 2)[:, 0]),
        "out must be contiguous",
    ),
    "outlier-block-too-large": (
        lambda: ops.quantize_int8_outliers(torch.ones(1024), 512, False, 0),
        "block_size must be at most 256",
    ),
    "restore-index-dtype": (
        lambda: ops.restore_block_outliers_(torch.zeros(128), torch.zeros(2), torch.zeros(2, dtype=torch.int8), 64),
        "index",
    ),
    "sum-scales-shape": (
        lambda: ops.dequantize_sum_int8(INT8_CODES.view(2, 4), torch.ones(2, 3), 4, 1.0),
        r"scales must have shape \[2, 1\]",
    ),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_kernels_reject_bad_arguments(case):
    call, message = BAD_CALLS[case]
    with pytest.raises(RuntimeError, match=message):
        call()


def _opcheck_samples():
    x = varied_magnitudes(1000, torch.bfloat16)
    codes, scales = ops.quantize_int8(x, 64, False, 0)
    packed, scales4 = ops.quantize_int4(x, 64, False, 0)
    sum_codes, sum_scales = dequantize_sum_inputs(3, 1000, 64)
    return [
        ("quantize_int8", (x, 64, False, 0)),
        ("quantize_int8", (x.float(), 64, True, 5)),
        ("quantize_int8_into", (x, 64, True, 5, torch.empty_like(codes), torch.empty_like(scales))),
        ("quantize_int4", (x, 64, True, 5)),
        ("dequantize_int8", (codes, scales, 64, torch.float16)),
        ("dequantize_int8_into", (codes, scales, 64, torch.empty(1000, dtype=torch.bfloat16))),
        ("dequantize_int4", (packed, scales4, 1000, 64, torch.float32)),
        ("dequantize_sum_int8", (sum_codes, sum_scales, 64, 0.5)),
        ("dequantize_sum_int8_into", (sum_codes, sum_scales, 64, 0.5, torch.empty(1000))),
        ("quantize_int8_outliers", (x, 64, False, 0)),
        ("quantize_int4_outliers", (x.float(), 64, True, 5)),
        ("restore_block_outliers_",
         (torch.zeros(1000, dtype=torch.bfloat16), *ops.quantize_int8_outliers(x, 64, False, 0)[2:], 64)),
        ("quantize_token_blocks", (x, 100, 10, 8, 64, False, 0)),
        ("quantize_token_blocks", (x.float(), 50, 20, 4, 64, True, 5)),
        ("restore_token_blocks", (*ops.quantize_token_blocks(x, 100, 10, 4, 64, False, 0), 100, 10, 4, 64)),
    ]


def test_opcheck_every_op():
    samples = _opcheck_samples()
    assert {name for name, _ in samples} == set(lazyzero.ops.quant._SCHEMAS)
    for op_name, args in samples:
        torch.library.opcheck(getattr(ops, op_name).default, args)
