"""The 8-bit Adam reference itself: the minifloat state codes, block scales, the step's arithmetic
against torch.optim, and the sum of squares."""

import math

import pytest
import torch

from lazyzero.ops import adam8bit_reference as ref
from lazyzero.testing import TOLERANCES, assert_close

M_BITS, S_BITS = ref.M_MANTISSA_BITS, ref.S_MANTISSA_BITS
# Largest magnitude code of each state (the code of 1.0) and its subnormal step.
LARGEST_CODE = {M_BITS: 120, S_BITS: 240}
SUBNORMAL_STEP = {M_BITS: 2.0**-17, S_BITS: 2.0**-18}


def all_magnitude_codes(mantissa_bits: int) -> torch.Tensor:
    return torch.arange(LARGEST_CODE[mantissa_bits] + 1, dtype=torch.int32)


def fp32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


@pytest.mark.parametrize("mantissa_bits", [M_BITS, S_BITS])
def test_every_magnitude_code_decodes_and_reencodes_to_itself(mantissa_bits):
    codes = all_magnitude_codes(mantissa_bits)
    values = ref.decode_magnitude(codes, mantissa_bits)
    assert torch.equal(ref.encode_magnitude(values, mantissa_bits), codes)
    assert values[0] == 0 and values[-1] == 1.0
    assert (values[1:] > values[:-1]).all()


@pytest.mark.parametrize("mantissa_bits", [M_BITS, S_BITS])
def test_codes_are_the_nearest_value_ties_to_even(mantissa_bits):
    table = ref.decode_magnitude(all_magnitude_codes(mantissa_bits), mantissa_bits).double()
    generator = torch.Generator().manual_seed(1)
    # Uniform in [0, 1], log-uniform down to 2^-30 (through the subnormal codes), and every
    # midpoint between neighbouring codes (all exactly representable in fp32).
    y = torch.cat([
        torch.rand(20000, generator=generator),
        torch.exp2(-30 * torch.rand(20000, generator=generator)),
        ((table[1:] + table[:-1]) / 2).float(),
    ])
    codes = ref.encode_magnitude(y, mantissa_bits).long()
    distance = (y.double()[:, None] - table[None, :]).abs()
    nearest = distance.min(dim=1).values
    assert torch.equal(distance.gather(1, codes[:, None])[:, 0], nearest)
    tie = (distance == nearest[:, None]).sum(dim=1) > 1
    assert tie.sum() >= len(table) - 1
    assert (codes[tie] % 2 == 0).all()


@pytest.mark.parametrize("mantissa_bits", [M_BITS, S_BITS])
def test_subnormal_boundary(mantissa_bits):
    step = SUBNORMAL_STEP[mantissa_bits]
    smallest_normal_code = 1 << mantissa_bits
    min_normal = 2.0**-14
    below = torch.nextafter(fp32([min_normal]), fp32([0.0])).item()
    cases = {
        0.0: 0,
        step / 2: 0,  # tie between codes 0 and 1: even
        step: 1,
        1.5 * step: 2,  # tie between 1 and 2: even
        (smallest_normal_code - 0.5) * step: smallest_normal_code,  # tie, to the even normal code
        below: smallest_normal_code,
        min_normal: smallest_normal_code,
        min_normal * (1 + 2.0**-mantissa_bits): smallest_normal_code + 1,
    }
    codes = ref.encode_magnitude(fp32(list(cases)), mantissa_bits)
    assert codes.tolist() == list(cases.values())
    decoded = ref.decode_magnitude(torch.arange(smallest_normal_code + 1, dtype=torch.int32),
                                   mantissa_bits)
    assert decoded.tolist() == [c * step for c in range(smallest_normal_code + 1)]


def test_first_moment_codes_carry_the_sign_in_bit_7():
    magnitudes = ref.decode_magnitude(torch.arange(1, 121, dtype=torch.int32), M_BITS)
    x = torch.cat([magnitudes, -magnitudes, fp32([0.0, -0.0])])
    codes, scales = ref.quantize_m(x, 256)
    assert scales.tolist() == [1.0]
    expected = list(range(1, 121)) + [128 + c for c in range(1, 121)] + [0, 0]
    assert codes.tolist() == expected
    assert torch.equal(ref.dequantize_m(codes, scales, 256), x)
    assert ref.dequantize_m(torch.tensor([128], dtype=torch.uint8), fp32([3.0]), 256).item() == 0


@pytest.mark.parametrize("quantize", [ref.quantize_m, ref.quantize_s], ids=["m", "s"])
def test_absmax_element_gets_the_code_of_one(quantize):
    generator = torch.Generator().manual_seed(2)
    blocks, block_size = 500, 64
    x = torch.randn(blocks * block_size, generator=generator)
    x = x * torch.exp2(torch.randint(-40, 40, (blocks, 1), generator=generator)).repeat(
        1, block_size).view(-1)
    if quantize is ref.quantize_s:
        x = x.abs()
    codes, scales = quantize(x, block_size)
    argmax = x.view(blocks, block_size).abs().argmax(dim=1)
    top_codes = codes.view(blocks, block_size).gather(1, argmax[:, None])[:, 0].int()
    if quantize is ref.quantize_m:
        top_codes = top_codes & 0x7F  # the magnitude, without the sign bit
    largest = LARGEST_CODE[M_BITS] if quantize is ref.quantize_m else LARGEST_CODE[S_BITS]
    assert (top_codes == largest).all()
    assert torch.equal(scales, x.view(blocks, block_size).abs().amax(dim=1))


@pytest.mark.parametrize("quantize", [ref.quantize_m, ref.quantize_s], ids=["m", "s"])
def test_zero_and_subnormal_blocks_flush_to_zero(quantize):
    tiny = torch.finfo(torch.float32).tiny
    x = torch.cat([torch.zeros(32), torch.full((32,), tiny / 4), fp32([tiny] + [0.0] * 31)])
    codes, scales = quantize(x, 32)
    assert scales.tolist() == [0.0, 0.0, tiny]
    assert (codes[:64] == 0).all()
    assert codes[64] in (LARGEST_CODE[M_BITS], LARGEST_CODE[S_BITS])
    assert (ref.dequantize_m(codes, scales, 32)[:64] == 0).all()


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1000])
def test_quantize_shapes_and_round_trip_error(n):
    generator = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=generator)
    codes, scales = ref.quantize_m(x, 32)
    assert codes.dtype == torch.uint8 and codes.shape == (n,)
    assert scales.dtype == torch.float32 and scales.shape == (-(-n // 32),)
    restored = ref.dequantize_m(codes, scales, 32)
    # Half a code step: 2^-4 relative for normal codes, half the subnormal step of the scale below.
    per_element_scale = scales.repeat_interleave(32)[:n]
    bound = torch.maximum(x.abs() * 2.0**-4, per_element_scale * 2.0**-18)
    # (1 + 2^-16): the fp32 roundings of |x| / scale and code * scale.
    assert ((restored - x).abs() <= bound * (1 + 2.0**-16)).all()


def run_against_torch(optimizer_class, decoupled: bool, steps: int = 20):
    """Max |param difference| between adam32_step_ and a torch.optim optimizer over `steps`."""
    lr, weight_decay, betas, eps = 1e-3, 0.1, (0.9, 0.999), 1e-8
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(4096, generator=generator)
    param = torch.nn.Parameter(start.clone())
    optimizer = optimizer_class([param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    ours, m, v = start.clone(), torch.zeros(4096), torch.zeros(4096)
    decay_factor, l2 = (1 - lr * weight_decay, 0.0) if decoupled else (1.0, weight_decay)
    for t in range(1, steps + 1):
        grad = torch.randn(4096, generator=generator)
        param.grad = grad.clone()
        optimizer.step()
        ref.adam32_step_(ours, grad, m, v, *betas, eps, lr / (1 - betas[0] ** t),
                         1 / math.sqrt(1 - betas[1] ** t), decay_factor, l2, 1.0)
    assert_close(ours, param.detach(), "adam32_vs_adamw")
    assert (ours - start).abs().max() > 10 * lr  # the run did move the parameters


def test_fp32_step_follows_torch_adamw():
    run_against_torch(torch.optim.AdamW, decoupled=True)


def test_fp32_step_follows_torch_adam_with_l2():
    run_against_torch(torch.optim.Adam, decoupled=False)


def test_8bit_step_from_fresh_state_moves_each_parameter_by_lr():
    # t = 1, zero states: m = (1 - b1) g and s = sqrt(1 - b2) |g|, so the update is lr * g / |g|.
    grad = fp32([3.0, -0.5, 0.0, 2.0])
    param = torch.ones(4)
    m_codes, v_codes = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    m_scales, v_scales = torch.zeros(1), torch.zeros(1)
    ref.adam8bit_step_(param, grad, m_codes, m_scales, v_codes, v_scales, 32, 0.9, 0.999, 1e-8,
                       1e-2 / 0.1, 1 / math.sqrt(0.001), 1.0, 0.0, 1.0)
    assert_close(param, fp32([0.99, 1.01, 1.0, 0.99]), "adam32_vs_adamw")
    expected_codes, expected_scales = ref.quantize_m(fp32([0.1]) * grad, 32)
    assert torch.equal(m_codes, expected_codes) and torch.equal(m_scales, expected_scales)
    assert m_codes[0] == LARGEST_CODE[M_BITS] and v_codes[0] == LARGEST_CODE[S_BITS]


def test_sum_squares_matches_float64():
    generator = torch.Generator().manual_seed(4)
    tensors = [torch.randn(10_000, generator=generator),
               torch.randn(3, 333, generator=generator).to(torch.bfloat16),
               torch.randn(5000, generator=generator).to(torch.float16),
               torch.empty(0)]
    expected = sum(t.double().square().sum() for t in tensors)
    result = ref.sum_squares(tensors)
    assert result.dtype == torch.float64 and result.dim() == 0
    assert abs(result.item() / expected.item() - 1) <= TOLERANCES["sum_squares_vs_fp64"]
    assert ref.sum_squares([]).item() == 0.0


def test_sum_squares_propagates_non_finite_values():
    assert ref.sum_squares([torch.ones(5), fp32([float("inf")])]).item() == math.inf
    assert math.isnan(ref.sum_squares([fp32([-math.inf, math.nan])]).item())
