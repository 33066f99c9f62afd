"""C++ CPU kernels of the fused Adam steps against the PyTorch reference, bit for bit; the
sum-of-squares kernel against float64; the Python wrappers' argument checks and fallback."""

import math

import pytest
import torch

import lazyzero.ops.adam8bit as adam8bit
from lazyzero.ops import adam8bit_reference as ref
from lazyzero.testing import TOLERANCES

ops = torch.ops.lazyzero
BETAS = (0.9, 0.999)
EPS = 1e-8
LR = 1e-3
WEIGHT_DECAY = 0.01
# "adamw": decoupled decay; "adam": L2 decay folded into the gradient; both with a loss scale.
MODES = {"adamw": (1 - LR * WEIGHT_DECAY, 0.0, 1.0), "adam": (1.0, WEIGHT_DECAY, 1 / 1024)}


def step_scalars(t: int, mode: str) -> tuple[float, ...]:
    decay_factor, l2_weight_decay, grad_scale = MODES[mode]
    return (*BETAS, EPS, LR / (1 - BETAS[0] ** t), 1 / math.sqrt(1 - BETAS[1] ** t),
            decay_factor, l2_weight_decay, grad_scale)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and bits (NaN payloads aside: any NaN equals any NaN; -0 != +0)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        both_nan = actual.isnan() & expected.isnan()
        same_bits = actual.view(torch.int32) == expected.view(torch.int32)
        mismatches = (~(same_bits | both_nan)).nonzero()
    else:
        mismatches = (actual != expected).nonzero()
    assert mismatches.numel() == 0, f"{len(mismatches)} elements differ, first at {mismatches[:5]}"


def fresh_8bit_state(n: int, block_size: int) -> list[torch.Tensor]:
    blocks = -(-n // block_size)
    return [torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks),
            torch.zeros(n, dtype=torch.uint8), torch.zeros(blocks)]


def gradients(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Normal gradients whose magnitude changes by powers of 2^10 every 64 elements (so blocks
    reach from subnormal codes to 1.0), with exact zeros in some stretches."""
    generator = torch.Generator().manual_seed(seed)
    result = []
    for _ in range(steps):
        exponents = torch.randint(-12, 3, (n // 64 + 1,), generator=generator).float() * 10
        grad = torch.randn(n, generator=generator) * torch.exp2(exponents).repeat_interleave(64)[:n]
        grad[(torch.arange(n) // 100) % 7 == 3] = 0.0
        result.append(grad)
    return result


def run_8bit_steps(n, block_size, mode, grads, param=None, state=None):
    """(param, state) after the given steps, native and reference, from the same start."""
    generator = torch.Generator().manual_seed(n)
    param = torch.randn(n, generator=generator) if param is None else param
    state = fresh_8bit_state(n, block_size) if state is None else state
    native_param, native_state = param.clone(), [s.clone() for s in state]
    ref_param, ref_state = param.clone(), [s.clone() for s in state]
    for t, grad in enumerate(grads, start=1):
        scalars = step_scalars(t, mode)
        ops.adam8bit_step_(native_param, grad, *native_state, block_size, *scalars)
        ref.adam8bit_step_(ref_param, grad, *ref_state, block_size, *scalars)
    return (native_param, native_state), (ref_param, ref_state)


def assert_8bit_steps_match(n, block_size, mode, grads, **start):
    (param, state), (ref_param, ref_state) = run_8bit_steps(n, block_size, mode, grads, **start)
    assert_bitwise_equal(param, ref_param)
    for actual, expected in zip(state, ref_state):
        assert_bitwise_equal(actual, expected)
    return param, state


@pytest.mark.usefixtures("native_cpu")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [32, 64, 256, 1024, 4096])
def test_8bit_step_matches_reference(block_size, mode):
    sizes = {1, block_size - 1, block_size, block_size + 1, 3 * block_size + 17, 20_011}
    for n in sorted(sizes):
        assert_8bit_steps_match(n, block_size, mode, gradients(n, 4, seed=n))


@pytest.mark.usefixtures("native_cpu")
def test_8bit_step_matches_reference_on_many_blocks():
    n = 2**18 + 3  # 1025 blocks: many parallel tasks, a partial last block
    _, state = assert_8bit_steps_match(n, 256, "adamw", gradients(n, 3, seed=9))
    assert (state[1] > 0).any() and (state[0] != 0).any()


@pytest.mark.slow
@pytest.mark.usefixtures("native_cpu")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [32, 256, 4096])
def test_8bit_step_matches_reference_on_eight_million_elements(block_size, mode):
    n = 2**23 + 5
    assert_8bit_steps_match(n, block_size, mode, gradients(n, 5, seed=block_size))


@pytest.mark.usefixtures("native_cpu")
def test_8bit_step_matches_reference_when_moments_decay_to_zero():
    # Gradients down to fp32 subnormals (2^-120 blocks), then zeros: the first moments decay by
    # beta1 per step through the subnormal codes and, where a block's absmax falls below 2^-126,
    # the block is flushed to scale 0.
    n, block_size = 4096, 64
    first = gradients(n, 1, seed=2)
    _, early_state = assert_8bit_steps_match(n, block_size, "adamw", first)
    _, state = assert_8bit_steps_match(n, block_size, "adamw", first + [torch.zeros(n)] * 60)
    assert (state[1] == 0).sum() > (early_state[1] == 0).sum()


def rounding_sweep() -> torch.Tensor:
    """Values in [0, 1] where rounding to a code is delicate: every midpoint between neighbouring
    m codes and s codes (ties), the floats just below and above each, and the subnormal range."""
    values = []
    for bits in (ref.M_MANTISSA_BITS, ref.S_MANTISSA_BITS):
        table = ref.decode_magnitude(torch.arange(16 << bits, dtype=torch.int32), bits)
        table = table[table <= 1.0]
        midpoints = (table[1:] + table[:-1]) / 2
        values += [midpoints, torch.nextafter(midpoints, torch.zeros(())),
                   torch.nextafter(midpoints, torch.ones(()))]
    values.append(torch.linspace(0, 2.0**-13, 5000))
    return torch.cat(values)


@pytest.mark.usefixtures("native_cpu")
def test_8bit_step_rounds_every_tie_like_the_reference():
    # beta1 = beta2 = 0 from a fresh state: m = g and s = sqrt(g * g) = |g| exactly for these
    # short-mantissa values, so the new codes are the codes of g itself. A 1.0 in every block
    # makes the scale 1 and y = |g|.
    block_size = 256
    sweep = rounding_sweep()
    sweep = torch.cat([sweep, -sweep])
    blocks = -(-sweep.numel() // (block_size - 1))
    body = torch.zeros(blocks * (block_size - 1))
    body[: sweep.numel()] = sweep
    grad = torch.cat([torch.ones(blocks, 1), body.view(blocks, block_size - 1)], dim=1).view(-1)
    n = grad.numel()
    state, expected_state = fresh_8bit_state(n, block_size), fresh_8bit_state(n, block_size)
    scalars = (0.0, 0.0, EPS, LR, 1.0, 1.0, 0.0, 1.0)
    ops.adam8bit_step_(torch.zeros(n), grad, *state, block_size, *scalars)
    ref.adam8bit_step_(torch.zeros(n), grad, *expected_state, block_size, *scalars)
    for actual, expected in zip(state, expected_state):
        assert_bitwise_equal(actual, expected)
    assert torch.equal(state[0], ref.quantize_m(grad, block_size)[0])
    assert torch.equal(state[2], ref.quantize_s(grad.abs(), block_size)[0])


@pytest.mark.usefixtures("native_cpu")
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_8bit_step_matches_reference_on_non_finite_gradients(special):
    n, block_size = 1000, 64
    grads = gradients(n, 2, seed=5)
    grads[1][70] = special
    (param, state), (ref_param, ref_state) = run_8bit_steps(n, block_size, "adam", grads)
    assert_bitwise_equal(param, ref_param)
    assert math.isnan(param[70]) and param[:64].isfinite().all() and param[128:].isfinite().all()
    for actual, expected in zip(state, ref_state):
        assert_bitwise_equal(actual, expected)
    assert not state[1][1].isfinite()  # the block's first-moment scale shows the NaN/Inf


@pytest.mark.usefixtures("native_cpu")
@pytest.mark.parametrize("mode", MODES)
def test_fp32_step_matches_reference(mode):
    for n in (1, 31, 1000, 2**17 + 5):
        generator = torch.Generator().manual_seed(n)
        param = torch.randn(n, generator=generator)
        native = [param.clone(), torch.zeros(n), torch.zeros(n)]
        expected = [param.clone(), torch.zeros(n), torch.zeros(n)]
        for t, grad in enumerate(gradients(n, 3, seed=n), start=1):
            ops.adam32_step_(native[0], grad, native[1], native[2], *step_scalars(t, mode))
            ref.adam32_step_(expected[0], grad, expected[1], expected[2], *step_scalars(t, mode))
        for actual, wanted in zip(native, expected):
            assert_bitwise_equal(actual, wanted)


def relative_error_vs_fp64(tensors) -> float:
    expected = sum(t.double().square().sum() for t in tensors)
    return abs(ops.sum_squares(tensors).item() / expected.item() - 1)


@pytest.mark.usefixtures("native_cpu")
def test_sum_squares_is_accurate_on_ten_million_elements():
    generator = torch.Generator().manual_seed(6)
    tensors = [torch.randn(10_000_000, generator=generator) * 3 + 1]
    assert relative_error_vs_fp64(tensors) <= TOLERANCES["sum_squares_vs_fp64"]


@pytest.mark.usefixtures("native_cpu")
def test_sum_squares_of_many_mixed_tensors():
    generator = torch.Generator().manual_seed(7)
    tensors = [torch.randn(n, generator=generator) for n in (0, 1, 4095, 4096, 4097, 0, 70_000)]
    tensors += [torch.randn(300, 300, generator=generator).t(),  # non-contiguous
                torch.randn(5000, generator=generator).to(torch.bfloat16),
                torch.randn(5001, generator=generator).to(torch.float16)]
    tensors += [torch.randn(17, generator=generator) for _ in range(500)]
    assert relative_error_vs_fp64(tensors) <= TOLERANCES["sum_squares_vs_fp64"]
    result = ops.sum_squares(tensors)
    assert result.dtype == torch.float64 and result.dim() == 0
    assert ops.sum_squares(tensors).item() == result.item()  # deterministic


@pytest.mark.usefixtures("native_cpu")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sum_squares_propagates_inf_and_nan(dtype):
    big = torch.ones(10_000, dtype=dtype)
    with_inf, with_nan, both = big.clone(), big.clone(), big.clone()
    with_inf[5000] = -math.inf
    with_nan[9999] = math.nan
    both[0], both[1] = math.inf, math.nan
    assert ops.sum_squares([big, with_inf]).item() == math.inf
    assert math.isnan(ops.sum_squares([with_nan, big]).item())
    assert math.isnan(ops.sum_squares([both]).item())


def small_8bit_args(n=100, block_size=32):
    """Valid wrapper arguments for an n-element 8-bit step."""
    return [torch.zeros(n), torch.zeros(n), *fresh_8bit_state(n, block_size), block_size,
            *step_scalars(1, "adamw")]


def replaced(args, index, value):
    return [value if i == index else arg for i, arg in enumerate(args)]


BAD_8BIT_CALLS = {
    "param-dtype": (replaced(small_8bit_args(), 0, torch.zeros(100, dtype=torch.float64)),
                    "param must be a contiguous torch.float32"),
    "grad-numel": (replaced(small_8bit_args(), 1, torch.zeros(99)), "grad must be .* 100 elements"),
    "grad-dtype": (replaced(small_8bit_args(), 1, torch.zeros(100, dtype=torch.bfloat16)),
                   "grad must be a contiguous torch.float32"),
    "m-codes-dtype": (replaced(small_8bit_args(), 2, torch.zeros(100, dtype=torch.int8)),
                      "m_codes must be a contiguous torch.uint8"),
    "m-scales-count": (replaced(small_8bit_args(), 3, torch.zeros(3)),
                       "m_scales must be .* 4 elements"),
    "v-codes-strided": (replaced(small_8bit_args(), 4, torch.zeros(200, dtype=torch.uint8)[::2]),
                        r"v_codes .*\(strided\)"),
    "v-scales-device": (replaced(small_8bit_args(), 5, torch.zeros(4, device="meta")),
                        "v_scales is on meta"),
    "block-not-power-of-two": (replaced(small_8bit_args(), 6, 48), "power of two in \\[32, 40"),
    "block-too-small": (replaced(small_8bit_args(), 6, 16), "power of two in \\[32, 4096\\]"),
    "block-bool": (replaced(small_8bit_args(), 6, True), "power of two"),
    "beta1": (replaced(small_8bit_args(), 7, 1.0), "beta1 must be in \\[0, 1\\)"),
    "beta2": (replaced(small_8bit_args(), 8, -0.1), "beta2 must be in \\[0, 1\\)"),
    "eps": (replaced(small_8bit_args(), 9, -1e-8), "eps must be non-negative"),
}


@pytest.mark.parametrize("case", BAD_8BIT_CALLS)
def test_8bit_wrapper_rejects_bad_arguments(case):
    args, message = BAD_8BIT_CALLS[case]
    with pytest.raises(ValueError, match=message):
        adam8bit.adam8bit_step_(*args)


def test_fp32_wrapper_rejects_bad_arguments():
    scalars = step_scalars(1, "adam")
    with pytest.raises(ValueError, match="v must be .* 10 elements"):
        adam8bit.adam32_step_(torch.zeros(10), torch.zeros(10), torch.zeros(10), torch.zeros(9),
                              *scalars)
    with pytest.raises(ValueError, match="param must be a contiguous"):
        adam8bit.adam32_step_(torch.zeros(4, 4).t(), torch.zeros(16), torch.zeros(16),
                              torch.zeros(16), *scalars)


def test_sum_squares_wrapper_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"tensors\[1\] must be a float32, bfloat16 or float16"):
        adam8bit.sum_squares([torch.ones(3), torch.ones(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"tensors\[0\] must be .* got list"):
        adam8bit.sum_squares([[1.0]])
    with pytest.raises(ValueError, match=r"tensors\[1\] is on meta"):
        adam8bit.sum_squares([torch.ones(3), torch.ones(3, device="meta")])
    assert adam8bit.sum_squares([]).item() == 0.0


@pytest.mark.usefixtures("native_cpu")
def test_kernels_check_their_arguments_too():
    args = small_8bit_args()
    with pytest.raises(RuntimeError, match="block_size must be a power of two"):
        ops.adam8bit_step_(*replaced(args, 6, 48))
    with pytest.raises(RuntimeError, match="m_scales must have 4 elements"):
        ops.adam8bit_step_(*replaced(args, 3, torch.zeros(3)))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.sum_squares([torch.ones(3, dtype=torch.float64)])


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference-fallback"])
def test_wrappers_give_the_reference_results(native, monkeypatch, request):
    if native:
        request.getfixturevalue("native_cpu")
    else:
        monkeypatch.setattr(adam8bit, "ensure_native", lambda device_type: False)
    n, block_size = 1000, 64
    grads = gradients(n, 2, seed=8)
    start = torch.randn(n, generator=torch.Generator().manual_seed(n))
    param, state = start.clone(), fresh_8bit_state(n, block_size)
    ref_param, ref_state = start.clone(), fresh_8bit_state(n, block_size)
    for t, grad in enumerate(grads, start=1):
        adam8bit.adam8bit_step_(param, grad, *state, block_size, *step_scalars(t, "adamw"))
        ref.adam8bit_step_(ref_param, grad, *ref_state, block_size, *step_scalars(t, "adamw"))
    assert_bitwise_equal(param, ref_param)
    for actual, expected in zip(state, ref_state):
        assert_bitwise_equal(actual, expected)
    tensors = [grads[0], grads[1].view(10, 100)]
    relative_error = adam8bit.sum_squares(tensors).item() / ref.sum_squares(tensors).item() - 1
    assert abs(relative_error) <= TOLERANCES["sum_squares_vs_fp64"]


@pytest.mark.usefixtures("native_cpu")
def test_opcheck_every_op():
    n, block_size = 300, 64
    grad = gradients(n, 1, seed=1)[0]
    samples = {
        "adam8bit_step_": (torch.randn(n), grad, *fresh_8bit_state(n, block_size), block_size,
                           *step_scalars(1, "adam")),
        "adam32_step_": (torch.randn(n), grad, torch.zeros(n), torch.zeros(n),
                         *step_scalars(1, "adamw")),
        "sum_squares": ([grad, torch.randn(7, dtype=torch.bfloat16)],),
    }
    assert set(samples) == set(adam8bit._SCHEMAS)
    for name, args in samples.items():
        torch.library.opcheck(getattr(ops, name).default, args)
