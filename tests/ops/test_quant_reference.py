"""The reference's building blocks that the kernels copy: the counter hash and the int4 layout."""

import pytest
import torch

from lazyzero.ops import quant_reference

UINT64 = (1 << 64) - 1


def splitmix64_mix(z: int) -> int:
    """The splitmix64 finalizer on Python ints, the ground truth for the int64-tensor version."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & UINT64
    return z ^ (z >> 31)


def expected_uniform(seed: int, index: int) -> float:
    key = splitmix64_mix(seed & UINT64)
    return (splitmix64_mix((key + index * 0x9E3779B97F4A7C15) & UINT64) >> 40) * 2.0**-24


@pytest.mark.parametrize("seed", [0, 1, -1, 2**63 - 1, -(2**63), 123456789])
def test_uniforms_follow_splitmix64(seed):
    for start in (0, 2**40 - 3):
        uniforms = quant_reference.uniform_from_counter(seed, start, 64)
        expected = [expected_uniform(seed, start + i) for i in range(64)]
        assert uniforms.tolist() == expected


def test_uniforms_are_24_bit_fractions_in_unit_interval():
    uniforms = quant_reference.uniform_from_counter(7, 0, 100_000).double()
    assert uniforms.min() >= 0 and uniforms.max() < 1
    assert torch.equal(uniforms * 2**24, (uniforms * 2**24).floor())
    # Mean of 1e5 uniforms: sigma = sqrt(1/12 / 1e5) ~ 9e-4; 5 sigma allowed.
    assert abs(uniforms.mean().item() - 0.5) < 5 * 9.2e-4


def test_int4_packs_even_elements_in_the_low_nibble():
    x = torch.tensor([7.0, -7.0, 1.0, -1.0, 3.0])  # absmax 7: scale 1
    packed, scales = quant_reference.quantize_int4(x, 6, False, 0)
    assert scales.tolist() == [1.0]
    assert packed.tolist() == [0x7 | (0x9 << 4), 0x1 | (0xF << 4), 0x3]
    restored = quant_reference.dequantize_int4(packed, scales, 5, 6, torch.float32)
    assert restored.tolist() == x.tolist()
