"""CUDA kernels of the fused Adam ops against the PyTorch reference (run on the CPU).

The 8-bit and fp32 steps must agree with the reference bit for bit on parameters, codes and scales,
over two steps (fresh states, then the states the first step wrote), for every block size and for
sizes that end in a partial block. sum_squares reduces in parallel, so it is held to the spec's
relative bound against an fp64 sum instead.

Marked `gpu`: skipped on machines without a CUDA device. The first test builds the CUDA library,
which takes a few minutes on a cold cache.
"""

from __future__ import annotations

import math

import pytest
import torch
from quant_samples import varied_magnitudes

from lazyzero.ops import adam8bit, adam8bit_reference, native_build
from lazyzero.testing import TOLERANCES, assert_close

pytestmark = pytest.mark.gpu
ops = torch.ops.lazyzero

BLOCK_SIZES = [32, 64, 128, 256, 512, 1024, 2048, 4096]
# The two ways the optimizer applies weight decay: decoupled (AdamW) and as an L2 term (Adam).
VARIANTS = {
    "adamw": dict(weight_decay=0.01, decoupled=True),
    "adam_l2": dict(weight_decay=0.01, decoupled=False),
}


@pytest.fixture(scope="module", autouse=True)
def native_cuda():
    assert native_build.ensure_native("cuda")


def host_scalars(step: int, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = True,
                 grad_scale: float = 1.0) -> tuple[float, ...]:
    """The ops' scalar arguments for step `step` (1-based), as the optimizer computes them."""
    beta1, beta2 = betas
    return (
        beta1,
        beta2,
        eps,
        lr / (1.0 - beta1**step),
        1.0 / math.sqrt(1.0 - beta2**step),
        1.0 - lr * weight_decay if decoupled else 1.0,
        0.0 if decoupled else weight_decay,
        grad_scale,
    )


def sizes_around(block_size: int) -> list[int]:
    """One element, one block give or take one element, a partial last block after several whole
    ones, and a size that is a multiple of no block size."""
    return [1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 2**20 + 3]


def per_element_magnitudes(n: int, seed: int) -> torch.Tensor:
    """Normal values whose magnitude changes by powers of ten from one element to the next, so
    that every block, even of 32 elements, has values coded as subnormal minifloats."""
    generator = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-8, 2, (n,), generator=generator)
    return torch.randn(n, generator=generator) * 10.0**exponents


def fresh_8bit_states(n: int, block_size: int) -> list[torch.Tensor]:
    """m_codes, m_scales, v_codes, v_scales of a parameter that has taken no step yet."""
    blocks = -(-n // block_size)
    return [torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks),
            torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks)]


def run_8bit_steps(param: torch.Tensor, grads: list[torch.Tensor], block_size: int,
                   check=None, **hyper) -> None:
    """Steps a CPU reference copy and a CUDA copy of `param` and its fresh states through `grads`;
    after each step `check(actual, expected)` compares [param, m_codes, m_scales, v_codes,
    v_scales] (default: all of them, bit for bit)."""
    expected = [param.clone(), *fresh_8bit_states(param.numel(), block_size)]
    actual = [t.cuda() for t in expected]
    for step, grad in enumerate(grads, start=1):
        scalars = host_scalars(step, **hyper)
        adam8bit_reference.adam8bit_step_(expected[0], grad, *expected[1:], block_size, *scalars)
        adam8bit.adam8bit_step_(actual[0], grad.cuda(), *actual[1:], block_size, *scalars)
        (check or assert_all_equal)(actual, expected)


def assert_all_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for got, want in zip(actual, expected, strict=True):
        assert_close(got.cpu(), want, "native_vs_reference")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_adam8bit_step_matches_reference(block_size, variant):
    for n in sizes_around(block_size):
        param = varied_magnitudes(n, seed=10)
        grads = [varied_magnitudes(n, seed=1), per_element_magnitudes(n, seed=2)]
        run_8bit_steps(param, grads, block_size, **VARIANTS[variant])


@pytest.mark.parametrize("block_size", [32, 256, 4096])
def test_adam8bit_step_zero_tiny_and_scaled_gradients(block_size):
    """Blocks of zeros (scale 0), of moments below 2^-126 (flushed to scale 0), and of ordinary
    values; gradients multiplied by a loss-scale inverse inside the step."""
    n = 7 * block_size + 5
    magnitudes = torch.tensor([0.0, 1e-37, 1e-30, 1e-3, 1.0, 1e3, 1e12])
    grads = []
    for seed in (3, 4):
        generator = torch.Generator().manual_seed(seed)
        per_block = magnitudes[torch.randperm(7, generator=generator)].repeat_interleave(block_size)
        grads.append(torch.randn(n, generator=generator) * torch.cat([per_block, torch.ones(5)]))
    run_8bit_steps(varied_magnitudes(n, seed=11), grads, block_size, grad_scale=2.0**-16)


@pytest.mark.parametrize("block_size", [32, 1024])
def test_adam8bit_step_nonfinite_gradients(block_size):
    """NaN / Inf gradients (the engine skips such steps): the kernel stays in bounds, parameters
    still match element by element, and blocks without a non-finite value match exactly."""
    n = 6 * block_size + 9
    nonfinite = varied_magnitudes(n, seed=6)
    nonfinite[3] = float("nan")
    nonfinite[block_size + 1] = float("inf")
    nonfinite[3 * block_size - 1] = float("-inf")
    untouched_from = 3 * block_size

    def params_and_finite_blocks(actual, expected):
        assert_close(actual[0].cpu(), expected[0], "native_vs_reference")
        for got, want in zip(actual[1:], expected[1:]):
            start = untouched_from if got.numel() == n else untouched_from // block_size
            assert_close(got.cpu()[start:], want[start:], "native_vs_reference")

    grads = [varied_magnitudes(n, seed=5), nonfinite]
    param = varied_magnitudes(n, seed=12)
    run_8bit_steps(param, grads, block_size, check=params_and_finite_blocks)


@pytest.mark.parametrize("variant", VARIANTS)
def test_adam32_step_matches_reference(variant):
    for n in [1, 255, 4097, 2**20 + 3]:
        expected = [varied_magnitudes(n, seed=13), torch.zeros(n), torch.zeros(n)]
        actual = [t.cuda() for t in expected]
        grads = [varied_magnitudes(n, seed=7), per_element_magnitudes(n, seed=8)]
        for step, grad in enumerate(grads, start=1):
            scalars = host_scalars(step, grad_scale=0.5, **VARIANTS[variant])
            adam8bit_reference.adam32_step_(expected[0], grad, *expected[1:], *scalars)
            adam8bit.adam32_step_(actual[0], grad.cuda(), *actual[1:], *scalars)
            assert_all_equal(actual, expected)


def fp64_sum_squares(tensors: list[torch.Tensor]) -> float:
    return sum(float((t.float().double() ** 2).sum()) for t in tensors)


def assert_sum_squares_within_bound(tensors: list[torch.Tensor]) -> None:
    result = adam8bit.sum_squares(tensors)
    assert result.dtype == torch.float64 and result.dim() == 0
    assert result.device == tensors[0].device
    expected = fp64_sum_squares(tensors)
    assert abs(result.item() - expected) <= TOLERANCES["sum_squares_vs_fp64"] * expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sum_squares_within_bound_of_fp64(dtype):
    assert_sum_squares_within_bound([varied_magnitudes(10_000_000, dtype, seed=9).cuda()])


def test_sum_squares_of_mixed_tensors():
    """Several tensors of every dtype, sizes off the 4096-element chunks, an empty one and a
    transposed (non-contiguous) one."""
    tensors = [
        varied_magnitudes(5_000_001, torch.float32, seed=14).cuda(),
        torch.empty(0, device="cuda"),
        varied_magnitudes(4097, torch.bfloat16, seed=15).cuda(),
        varied_magnitudes(3000 * 1001, torch.float16, seed=16).cuda().view(3000, 1001).t(),
        varied_magnitudes(1, torch.float32, seed=17).cuda(),
    ]
    assert_sum_squares_within_bound(tensors)


def test_sum_squares_of_empty_tensors_is_zero_on_their_device():
    result = adam8bit.sum_squares([torch.empty(0, device="cuda"), torch.empty(0, 3, device="cuda")])
    assert result.device.type == "cuda" and result.item() == 0.0


@pytest.mark.parametrize(
    "specials, expected",
    [((float("inf"),), math.inf), ((float("-inf"),), math.inf), ((float("nan"),), math.nan),
     ((float("inf"), float("nan")), math.nan)],
    ids=["inf", "minus_inf", "nan", "inf_and_nan"],
)
def test_sum_squares_propagates_nonfinite(specials, expected):
    x = varied_magnitudes(100_000, seed=18)
    for offset, special in enumerate(specials):
        x[50_000 + 4096 * offset] = special
    result = adam8bit.sum_squares([varied_magnitudes(9000, seed=19).cuda(), x.cuda()]).item()
    assert math.isnan(result) if math.isnan(expected) else result == expected


def test_opcheck_every_op_on_cuda():
    n, block_size = 1000, 64
    param, grad = varied_magnitudes(n, seed=20).cuda(), varied_magnitudes(n, seed=21).cuda()
    states_8bit = [t.cuda() for t in fresh_8bit_states(n, block_size)]
    states_32 = [torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    samples = [
        ("adam8bit_step_", (param, grad, *states_8bit, block_size, *host_scalars(1))),
        ("adam32_step_", (param, grad, *states_32, *host_scalars(1))),
        ("sum_squares", ([grad, grad.half()],)),
    ]
    assert {name for name, _ in samples} == set(adam8bit._SCHEMAS)
    for op_name, args in samples:
        torch.library.opcheck(getattr(ops, op_name).default, args)
