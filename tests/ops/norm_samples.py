"""Sample inputs shared by the RMSNorm op tests (CPU kernels, CUDA kernels)."""

from __future__ import annotations

import torch

from lazyzero.testing import assert_close

EPS = 1e-6
# (x dtype, weight dtype): a bf16 model, an fp32 model, fp16, and the mixed ones torch promotes.
DTYPE_PAIRS = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float16, torch.float16),
               (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)]
# (leading shape, width): one row, odd widths, a width under one warp, many rows, a wide row.
SHAPES = [((1,), 64), ((3, 7), 77), ((5,), 1), ((2, 1000), 33), ((4,), 4099), ((3000,), 128)]
GRAD_WANTS = [(True, True), (True, False), (False, True), (False, False)]


def norm_inputs(lead: tuple, width: int, x_dtype, weight_dtype, seed: int = 0):
    """x with rows of very different scales, a weight near 1, and an output gradient of the output's dtype."""
    generator = torch.Generator().manual_seed(seed)
    scales = 10.0 ** torch.randint(-2, 3, (*lead, 1), generator=generator)
    x = (torch.randn(*lead, width, generator=generator) * scales).to(x_dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=generator)).to(weight_dtype)
    grad_y = torch.randn(*lead, width, generator=generator).to(torch.result_type(weight, x))
    return x, weight, grad_y


def assert_norm_close(found: torch.Tensor, expected: torch.Tensor) -> None:
    assert found.dtype == expected.dtype and found.shape == expected.shape
    kind = "norm_fp32_vs_reference" if expected.dtype == torch.float32 else "norm_16bit_vs_reference"
    assert_close(found.cpu(), expected, kind)
