"""Adam8bit / AdamW8bit against torch.optim.AdamW in fp32, state round trips (docs/reliability.md, what is tested).

The problem: least squares W x ~ y with fresh random batches each step, so gradients stay noisy and
of mixed scale as in training. Shapes: a multiple of the block size (64 x 64 = 4096) and not
(37 x 111 = 4107, and a 300-element tensor smaller than one 512-block).
"""

import io

import pytest
import torch

from lazyzero.optimizer import Adam8bit, AdamW8bit
from lazyzero.testing import TOLERANCES

SHAPES = [(64, 64), (37, 111), (300,)]
STEPS = 100


def make_params(shape, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Parameter(torch.randn(shape) * 0.1)


def set_gradient(param, step):
    """Gradient of 0.5 * ||A * (w - w*)||^2 on a random diagonal batch, plus noise; depends only on
    the current parameter value and the step."""
    generator = torch.Generator().manual_seed(step)
    target = torch.randn(param.shape, generator=generator) * 0.05
    weight = torch.rand(param.shape, generator=generator) ** 4 * 10.0  # scales over four decades
    noise = torch.randn(param.shape, generator=generator) * 1e-3
    param.grad = (weight * (param.detach() - target) + noise).contiguous()


def run(optimizer_class, shape, steps=STEPS, **options):
    param = make_params(shape)
    optimizer = optimizer_class([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, **options)
    for step in range(steps):
        set_gradient(param, step)
        optimizer.step()
    return param, optimizer


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("block_size", [64, 512])
def test_adamw8bit_tracks_fp32_adamw(shape, block_size):
    expected, reference = run(torch.optim.AdamW, shape)
    found, optimizer = run(AdamW8bit, shape, block_size=block_size, min_8bit_size=0)
    start = make_params(shape)
    moved = (expected.detach() - start.detach()).norm()
    error = (found.detach() - expected.detach()).norm()
    assert error <= TOLERANCES["adam8bit_vs_adamw_update"] * moved, (float(error / moved))
    state, reference_state = optimizer.dequantized_state(found), reference.state[expected]
    for key in ("exp_avg", "exp_avg_sq"):
        error = (state[key] - reference_state[key]).norm() / reference_state[key].norm()
        assert error <= TOLERANCES["adam8bit_state_" + key], (key, float(error))


def test_fp32_states_follow_torch_adamw_closely():
    expected, _ = run(torch.optim.AdamW, (37, 111))
    found, optimizer = run(AdamW8bit, (37, 111), state_bits=32)
    assert "exp_avg" in optimizer.state[found]
    torch.testing.assert_close(found.detach(), expected.detach(), **TOLERANCES["adam32_vs_adamw"])


def test_adam8bit_l2_decay_differs_from_adamw_decay():
    adam, _ = run(Adam8bit, (64, 64), steps=20, min_8bit_size=0)
    adamw, _ = run(AdamW8bit, (64, 64), steps=20, min_8bit_size=0)
    assert not torch.equal(adam, adamw)


def test_small_tensors_keep_fp32_states():
    _, optimizer = run(AdamW8bit, (300,), steps=1, min_8bit_size=4096)
    (state,) = optimizer.state.values()
    assert "exp_avg" in state and "m_codes" not in state


def test_state_bytes_per_parameter():
    param, optimizer = run(AdamW8bit, (4096, 64), steps=1, block_size=256)
    # 2 code bytes + 2 fp32 scales per 256 elements.
    assert optimizer.state_bytes() / param.numel() == pytest.approx(2 + 8 / 256)


def test_save_and_reload_in_the_middle_is_exact(tmp_path):
    straight, straight_optimizer = run(AdamW8bit, (37, 111), min_8bit_size=0, block_size=64)

    param, optimizer = run(AdamW8bit, (37, 111), steps=STEPS // 2, min_8bit_size=0, block_size=64)
    buffer = io.BytesIO()
    torch.save({"param": param.detach().clone(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = torch.nn.Parameter(saved["param"])
    resumed_optimizer = AdamW8bit([resumed], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                                  min_8bit_size=0, block_size=64)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    state, expected_state = resumed_optimizer.state[resumed], optimizer.state[param]
    for key in ("m_codes", "m_scales", "sqrt_v_codes", "sqrt_v_scales"):
        assert state[key].dtype == expected_state[key].dtype and torch.equal(state[key], expected_state[key]), key
    for step in range(STEPS // 2, STEPS):
        set_gradient(resumed, step)
        resumed_optimizer.step()
        assert torch.isfinite(resumed).all(), step
    assert torch.equal(resumed.detach(), straight.detach())
    assert torch.equal(resumed_optimizer.state[resumed]["m_codes"], straight_optimizer.state[straight]["m_codes"])


def test_grad_scale_is_applied_inside_the_step():
    halved, _ = run(AdamW8bit, (64, 64), steps=5, min_8bit_size=0)
    param = make_params((64, 64))
    optimizer = AdamW8bit([param], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, min_8bit_size=0)
    optimizer.grad_scale = 0.5
    for step in range(5):
        set_gradient(param, step)
        param.grad.mul_(2.0)  # exact: powers of two
        optimizer.step()
    assert torch.equal(param.detach(), halved.detach())


def test_nonfinite_grad_scale_skips_the_step():
    param, optimizer = run(AdamW8bit, (64, 64), steps=3, min_8bit_size=0)
    before = param.detach().clone()
    codes = optimizer.state[param]["m_codes"].clone()
    optimizer.grad_scale = float("nan")
    set_gradient(param, 3)
    optimizer.step()
    assert torch.equal(param.detach(), before) and torch.equal(optimizer.state[param]["m_codes"], codes)
    assert optimizer.state[param]["step"] == 3


@pytest.mark.parametrize("options, message", [
    ({"block_size": 100}, "block_size must be a power of two"),
    ({"state_bits": 4}, "state_bits must be 8 or 32"),
    ({"betas": (0.9, 1.0)}, "betas must be two values"),
])
def test_bad_hyperparameters_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        AdamW8bit([make_params((4,))], **options)


def test_non_fp32_parameters_are_rejected():
    param = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    param.grad = torch.randn_like(param)
    with pytest.raises(ValueError, match="contiguous fp32 parameters"):
        AdamW8bit([param]).step()
