"""CUDA kernels against the PyTorch reference (computed on the CPU): bit for bit.

Marked `gpu`: skipped on machines without a CUDA device. The first test builds the CUDA library,
which takes a few minutes on a cold cache.
"""

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
from lazyzero.ops import dequantize_blockwise, native_build, quant_reference, quantize_blockwise
from lazyzero.testing import assert_close

pytestmark = pytest.mark.gpu
ops = torch.ops.lazyzero


@pytest.fixture(scope="module", autouse=True)
def native_cuda():
    assert native_build.ensure_native("cuda")


def cpu(tensors):
    return [t.cpu() for t in tensors]


def assert_cuda_quantize_matches_reference(op_name, x, block_size, stochastic, seed=99):
    actual = cpu(getattr(ops, op_name)(x.cuda(), block_size, stochastic, seed))
    expected = getattr(quant_reference, op_name)(x, block_size, stochastic, seed)
    for got, want in zip(actual, expected):
        assert_close(got, want, "native_vs_reference")


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", QUANTIZE_OPS)
@pytest.mark.parametrize("block_size", [64, 256, 4096])
def test_quantize_matches_reference(op_name, dtype, block_size, stochastic):
    for n in sizes_around(block_size) + [2**20 + 1]:
        x = varied_magnitudes(n, dtype)
        assert_cuda_quantize_matches_reference(op_name, x, block_size, stochastic)
    x = with_special_values(8 * block_size + 5, block_size, dtype)
    assert_cuda_quantize_matches_reference(op_name, x, block_size, stochastic)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", OUTLIER_OPS)
@pytest.mark.parametrize("block_size", [2, 64, 256])
def test_quantize_with_outliers_matches_reference(op_name, dtype, block_size, stochastic):
    for n in sizes_around(block_size) + [2**20 + 1]:
        assert_cuda_quantize_matches_reference(op_name, with_outliers(n, block_size, dtype), block_size, stochastic)
    x = with_special_values(8 * block_size + 5, block_size, dtype) if block_size >= 8 else with_outliers(99, 2, dtype)
    assert_cuda_quantize_matches_reference(op_name, x, block_size, stochastic)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_restore_block_outliers_matches_reference(dtype):
    x = with_outliers(2**20 + 3, 256, torch.float32)
    codes, scales, values, index = quant_reference.quantize_int8_outliers(x, 256, False, 0)
    expected = quant_reference.dequantize_int8(codes, scales, 256, dtype)
    out = expected.cuda()
    quant_reference.restore_block_outliers_(expected, values, index, 256)
    ops.restore_block_outliers_(out, values.cuda(), index.cuda(), 256)
    assert_close(out.cpu(), expected, "native_vs_reference")


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_quantize_int8_into_matches_reference(stochastic):
    x = with_special_values(2**20 + 7, 256, torch.float32)
    codes = torch.empty(x.numel(), dtype=torch.int8, device="cuda")
    scales = torch.empty(-(-x.numel() // 256), device="cuda")
    ops.quantize_int8_into(x.cuda(), 256, stochastic, 5, codes, scales)
    expected_codes, expected_scales = quant_reference.quantize_int8(x, 256, stochastic, 5)
    assert_close(codes.cpu(), expected_codes, "native_vs_reference")
    assert_close(scales.cpu(), expected_scales, "native_vs_reference")


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_dequantize_matches_reference(out_dtype):
    x = with_special_values(2**20 + 3, 256, torch.float32)
    codes, scales = quant_reference.quantize_int8(x, 256, False, 0)
    actual = ops.dequantize_int8(codes.cuda(), scales.cuda(), 256, out_dtype).cpu()
    expected = quant_reference.dequantize_int8(codes, scales, 256, out_dtype)
    assert_close(actual, expected, "native_vs_reference")
    into = torch.empty(x.numel(), dtype=out_dtype, device="cuda")
    ops.dequantize_int8_into(codes.cuda(), scales.cuda(), 256, into)
    assert_close(into.cpu(), expected, "native_vs_reference")
    packed, scales4 = quant_reference.quantize_int4(x, 256, False, 0)
    actual = ops.dequantize_int4(packed.cuda(), scales4.cuda(), x.numel(), 256, out_dtype).cpu()
    expected = quant_reference.dequantize_int4(packed, scales4, x.numel(), 256, out_dtype)
    assert_close(actual, expected, "native_vs_reference")


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_dequantize_sum_matches_reference(rows):
    for n, block_size, alpha in [(1, 64, 0.5), (4097, 256, 1 / 3), (2**20 + 5, 256, 0.25)]:
        codes, scales = dequantize_sum_inputs(rows, n, block_size, seed=rows)
        expected = quant_reference.dequantize_sum_int8(codes, scales, block_size, alpha)
        actual = ops.dequantize_sum_int8(codes.cuda(), scales.cuda(), block_size, alpha)
        assert_close(actual.cpu(), expected, "native_vs_reference")
        out = torch.empty(n, device="cuda")
        ops.dequantize_sum_int8_into(codes.cuda(), scales.cuda(), block_size, alpha, out)
        assert_close(out.cpu(), expected, "native_vs_reference")


def test_public_api_runs_the_cuda_kernels():
    x = varied_magnitudes(10_000, torch.bfloat16).cuda()
    q = quantize_blockwise(x, bits=4, block_size=128, stochastic=True, seed=3)
    assert q.codes.is_cuda and q.scales.is_cuda
    expected, _ = quant_reference.quantize_int4(x.cpu(), 128, True, 3)
    assert torch.equal(q.codes.cpu(), expected)
    assert dequantize_blockwise(q).device == x.device


def test_opcheck_every_op_on_cuda():
    x = varied_magnitudes(1000, torch.float16).cuda()
    codes, scales = ops.quantize_int8(x, 64, False, 0)
    packed, scales4 = ops.quantize_int4(x, 64, False, 0)
    sum_codes, sum_scales = (t.cuda() for t in dequantize_sum_inputs(2, 1000, 64))
    sum_out = torch.empty(1000, device="cuda")
    samples = [
        ("quantize_int8", (x, 64, True, 1)),
        ("quantize_int8_into", (x, 64, True, 1, torch.empty_like(codes), torch.empty_like(scales))),
        ("quantize_int4", (x, 64, False, 0)),
        ("dequantize_int8", (codes, scales, 64, torch.bfloat16)),
        ("dequantize_int8_into", (codes, scales, 64, torch.empty(1000, device="cuda"))),
        ("dequantize_int4", (packed, scales4, 1000, 64, torch.float32)),
        ("dequantize_sum_int8", (sum_codes, sum_scales, 64, 0.5)),
        ("dequantize_sum_int8_into", (sum_codes, sum_scales, 64, 0.5, sum_out)),
        ("quantize_int8_outliers", (x, 64, True, 1)),
        ("quantize_int4_outliers", (x, 64, False, 0)),
        ("restore_block_outliers_",
         (torch.zeros(1000, device="cuda"), *ops.quantize_int8_outliers(x, 64, False, 0)[2:], 64)),
        ("quantize_token_blocks", (x, 100, 10, 8, 64, True, 1)),
        ("restore_token_blocks", (*ops.quantize_token_blocks(x, 100, 10, 4, 64, False, 0), 100, 10, 4, 64)),
    ]
    assert {name for name, _ in samples} == set(lazyzero.ops.quant._SCHEMAS)
    for op_name, args in samples:
        torch.library.opcheck(getattr(ops, op_name).default, args)
