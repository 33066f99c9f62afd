"""Fused Adam/AdamW steps (8-bit block-scaled states, or fp32 states) and the gradient sum of
squares: op schemas, fake kernels and the Python API.

The schemas are defined once, in namespace `lazyzero`; the CPU kernels come from C++
(csrc/adam8bit/adam_cpu.cpp), the CUDA kernels from csrc/adam8bit/adam_cuda.cu, attached when
`lazyzero.ops.native_build` loads the native libraries on first use. The numerics, including the state
code and the exact order of the fp32 operations, are specified by `lazyzero.ops.adam8bit_reference`,
which the step kernels match bit for bit.

The wrappers take the per-step host scalars that the optimizer computes from lr, the betas and the
step count t (see the reference's module docstring), check their arguments, and call the native op,
or the reference on a CPU-only machine where the kernels cannot be built.
"""

from __future__ import annotations

import torch

from lazyzero.ops import adam8bit_reference
from lazyzero.ops.adam8bit_reference import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    dequantize_m,
    dequantize_s,
    quantize_m,
    quantize_s,
)
from lazyzero.ops.native_build import ensure_native

__all__ = [
    "adam32_step_",
    "adam8bit_step_",
    "dequantize_m",
    "dequantize_s",
    "quantize_m",
    "quantize_s",
    "sum_squares",
]

SUM_SQUARES_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_SCALARS = (
    "float beta1, float beta2, float eps, float step_size, float inv_sqrt_bias_correction2, "
    "float decay_factor, float l2_weight_decay, float grad_scale"
)
_SCHEMAS = {
    "adam8bit_step_": (
        "(Tensor(a!) param, Tensor grad, Tensor(b!) m_codes, Tensor(c!) m_scales, "
        f"Tensor(d!) v_codes, Tensor(e!) v_scales, int block_size, {_SCALARS}) -> ()"
    ),
    "adam32_step_": (
        f"(Tensor(a!) param, Tensor grad, Tensor(b!) m, Tensor(c!) v, {_SCALARS}) -> ()"
    ),
    "sum_squares": "(Tensor[] tensors) -> Tensor",
}

for _name, _schema in _SCHEMAS.items():
    torch.library.define(f"lazyzero::{_name}", _schema)


@torch.library.register_fake("lazyzero::adam8bit_step_")
def _adam8bit_step_fake(param, grad, m_codes, m_scales, v_codes, v_scales, block_size, *scalars):
    return None


@torch.library.register_fake("lazyzero::adam32_step_")
def _adam32_step_fake(param, grad, m, v, *scalars):
    return None


@torch.library.register_fake("lazyzero::sum_squares")
def _sum_squares_fake(tensors):
    return tensors[0].new_empty((), dtype=torch.float64)


def _run(op_name: str, device: torch.device, *args):
    """The native op when its kernels are loaded for `device`, else the reference (CPU only)."""
    if device.type == "meta" or ensure_native(device.type):
        return getattr(torch.ops.lazyzero, op_name)(*args)
    return getattr(adam8bit_reference, op_name)(*args)


def _check_tensor(tensor, name: str, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype or tensor.numel() != numel or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {dtype} tensor of {numel} elements, got "
            f"{tensor.dtype} {list(tensor.shape)}{'' if tensor.is_contiguous() else ' (strided)'}"
        )
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, param on {device}")


def _check_param_and_grad(param, grad) -> None:
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"param must be a tensor, got {type(param).__name__}")
    _check_tensor(param, "param", torch.float32, param.numel(), param.device)
    _check_tensor(grad, "grad", torch.float32, param.numel(), param.device)


def _check_block_size(block_size) -> None:
    valid = (
        isinstance(block_size, int)
        and not isinstance(block_size, bool)
        and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
        and block_size & (block_size - 1) == 0
    )
    if not valid:
        raise ValueError(
            f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
            f"got {block_size!r}"
        )


def _scalar_args(beta1, beta2, eps, step_size, inv_sqrt_bias_correction2, decay_factor,
                 l2_weight_decay, grad_scale) -> tuple[float, ...]:
    """The scalars as Python floats; betas must lie in [0, 1) and eps be non-negative."""
    values = tuple(float(v) for v in (beta1, beta2, eps, step_size, inv_sqrt_bias_correction2,
                                      decay_factor, l2_weight_decay, grad_scale))
    for name, value in (("beta1", values[0]), ("beta2", values[1])):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")
    if not values[2] >= 0.0:
        raise ValueError(f"eps must be non-negative, got {values[2]}")
    return values


def adam8bit_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    block_size: int,
    beta1: float,
    beta2: float,
    eps: float,
    step_size: float,
    inv_sqrt_bias_correction2: float,
    decay_factor: float,
    l2_weight_decay: float,
    grad_scale: float,
) -> None:
    """One fused Adam/AdamW step with 8-bit states; param and all four states updated in place.

    param, grad: contiguous fp32, n elements each (any shape). m_codes / v_codes: contiguous uint8
    [n]; m_scales / v_scales: contiguous fp32 [ceil(n / block_size)]; block_size a power of two in
    [32, 4096]. Fresh states are zeros. The scalars are the per-step host values (step_size =
    lr / (1 - beta1^t), inv_sqrt_bias_correction2 = 1 / sqrt(1 - beta2^t); AdamW:
    decay_factor = 1 - lr * weight_decay, l2_weight_decay = 0; Adam: decay_factor = 1,
    l2_weight_decay = weight_decay); grad is multiplied by grad_scale first (e.g. 1 / loss_scale).
    """
    _check_block_size(block_size)
    _check_param_and_grad(param, grad)
    n, device = param.numel(), param.device
    blocks = -(-n // block_size)
    _check_tensor(m_codes, "m_codes", torch.uint8, n, device)
    _check_tensor(m_scales, "m_scales", torch.float32, blocks, device)
    _check_tensor(v_codes, "v_codes", torch.uint8, n, device)
    _check_tensor(v_scales, "v_scales", torch.float32, blocks, device)
    scalars = _scalar_args(beta1, beta2, eps, step_size, inv_sqrt_bias_correction2, decay_factor,
                           l2_weight_decay, grad_scale)
    _run("adam8bit_step_", device, param, grad, m_codes, m_scales, v_codes, v_scales, block_size,
         *scalars)


def adam32_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    step_size: float,
    inv_sqrt_bias_correction2: float,
    decay_factor: float,
    l2_weight_decay: float,
    grad_scale: float,
) -> None:
    """One fused Adam/AdamW step with fp32 states m and v (contiguous, n elements), in place.

    Same arguments and arithmetic as `adam8bit_step_`, without quantization of the states.
    """
    _check_param_and_grad(param, grad)
    _check_tensor(m, "m", torch.float32, param.numel(), param.device)
    _check_tensor(v, "v", torch.float32, param.numel(), param.device)
    scalars = _scalar_args(beta1, beta2, eps, step_size, inv_sqrt_bias_correction2, decay_factor,
                           l2_weight_decay, grad_scale)
    _run("adam32_step_", param.device, param, grad, m, v, *scalars)


def sum_squares(tensors) -> torch.Tensor:
    """0-dim float64 sum of x * x over all elements of `tensors` (fp32 / bf16 / fp16, any shape,
    all on one device); the squared global L2 norm used for gradient clipping and overflow checks.

    Squares are taken and summed in fp32 within chunks of 4096 elements, chunks summed in float64
    (relative error about 1e-7). NaN / Inf in any input give a NaN / Inf result. An empty sequence
    gives a CPU zero.
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    device = tensors[0].device if isinstance(tensors[0], torch.Tensor) else None
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in SUM_SQUARES_DTYPES:
            described = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(
                f"tensors[{index}] must be a float32, bfloat16 or float16 tensor, got {described}"
            )
        if tensor.device != device:
            raise ValueError(f"tensors[{index}] is on {tensor.device}, tensors[0] on {device}")
    return _run("sum_squares", device, tensors)
