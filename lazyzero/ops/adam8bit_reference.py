"""Pure-PyTorch reference of the fused Adam ops: the specification the kernels match bit for bit.

`adam8bit_step_`, `adam32_step_` and `sum_squares` have exactly the signatures of the
`torch.ops.lazyzero` ops of the same names, so the wrappers in `lazyzero.ops.adam8bit` call either.
The C++ (csrc/adam8bit/adam_cpu.cpp) and CUDA (csrc/adam8bit/adam_cuda.cu) kernels perform the same fp32
operations in the same order (csrc/adam8bit/adam_common.h) and agree with this module bit for bit on
parameters, codes and scales. `sum_squares` is the exception: its kernels reduce in parallel, so
they agree with it within a stated bound only.

Block-scaled minifloat states
-----------------------------
A flat state of n elements is cut into blocks of `block_size` consecutive elements (a power of two,
32..4096; the last block may be shorter). Each block keeps one fp32 scale and one uint8 code per
element:

* scale = max |x| over the block, except that an absmax below 2^-126 (zero, or subnormal) gives
  scale 0: the block is flushed to zero, since 1 / scale could overflow and such values are far
  below what an Adam update resolves. NaN / Inf propagate into the scale.
* inv = 1 / scale in fp32 (0 when scale is 0); y = min(|x| * inv, 1) in fp32, where a NaN product
  also becomes 1 (codes of non-finite blocks are unspecified upstream; these just stay in range).
* The magnitude y is coded as a minifloat with exponent bias 15 and `mantissa_bits` mantissa bits
  (`encode_magnitude`): y >= 2^-14 rounds its fp32 mantissa to nearest even on the bit pattern;
  below, the subnormal code round_half_even(y * 2^(14 + mantissa_bits)). Decoding
  (`decode_magnitude`) is exact, and x_hat = decoded * scale is one fp32 multiply.
* First moment m (signed): E4M3, code = (x < 0) << 7 | magnitude code (codes 0..120 and 128..248;
  -0 encodes as +0; a tiny negative that rounds to magnitude 0 keeps its sign bit, decoding to -0).
* Second moment v: its square root s = sqrt(v) is stored, unsigned E4M4 (codes 0..240), so the
  update divides by a value quantized on its own scale; v_hat = s_hat * s_hat.

Adam element update (fp32, this order, no fused multiply-add)
-------------------------------------------------------------
    g = grad * grad_scale;  g = g + l2_weight_decay * p
    m = beta1 * m_hat + (1 - beta1) * g
    v = beta2 * v_hat + (1 - beta2) * (g * g);  s = sqrt(v)  (IEEE, correctly rounded)
    denom = s * inv_sqrt_bias_correction2 + eps
    p = p * decay_factor;  p = p - step_size * (m / denom)
Every scalar argument arrives as a Python float (double) and is rounded to fp32 once; 1 - beta1 and
1 - beta2 are taken in double before that rounding. The caller passes step_size =
lr / (1 - beta1^t), inv_sqrt_bias_correction2 = 1 / sqrt(1 - beta2^t), and for AdamW
decay_factor = 1 - lr * weight_decay, l2_weight_decay = 0; for Adam decay_factor = 1,
l2_weight_decay = weight_decay. Fresh 8-bit states are all-zero codes and scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazyzero.ops.quant_reference import _blocks, _expand_scales

M_MANTISSA_BITS = 3
S_MANTISSA_BITS = 4
MIN_BLOCK_SIZE = 32
MAX_BLOCK_SIZE = 4096
SUM_SQUARES_CHUNK = 4096
# fp32 exponent bias (127) minus the codes' exponent bias (15).
_EXPONENT_REBIAS = 112
# Bits of 2^-14, the smallest normal code value.
_MIN_NORMAL_CODE_BITS = 0x38800000
_SIGN_CODE_BIT = 0x80
_FLOAT32_MIN_NORMAL = torch.finfo(torch.float32).tiny


def encode_magnitude(y: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """int32 minifloat codes (bias 15, `mantissa_bits` mantissa bits) of fp32 0 <= y <= 1."""
    u = y.view(torch.int32)
    dropped = 23 - mantissa_bits
    lowest_kept_bit = (u >> dropped) & 1
    rounded = (u + ((1 << (dropped - 1)) - 1) + lowest_kept_bit) & ~((1 << dropped) - 1)
    exponent = (rounded >> 23) - _EXPONENT_REBIAS
    mantissa = (rounded >> dropped) & ((1 << mantissa_bits) - 1)
    normal = (exponent << mantissa_bits) | mantissa
    subnormal = torch.round(y * 2.0 ** (14 + mantissa_bits)).to(torch.int32)
    return torch.where(u >= _MIN_NORMAL_CODE_BITS, normal, subnormal)


def decode_magnitude(codes: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """fp32 values of int32 minifloat codes, exactly (inverse of `encode_magnitude`)."""
    exponent = codes >> mantissa_bits
    mantissa = codes & ((1 << mantissa_bits) - 1)
    normal_bits = ((exponent + _EXPONENT_REBIAS) << 23) | (mantissa << (23 - mantissa_bits))
    subnormal = mantissa.to(torch.float32) * 2.0 ** -(14 + mantissa_bits)
    return torch.where(exponent == 0, subnormal, normal_bits.view(torch.float32))


def _block_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale (absmax, 0 when below 2^-126) and its fp32 inverse (0 for scale 0)."""
    absmax = blocks.abs().amax(dim=1)
    scales = torch.where(absmax < _FLOAT32_MIN_NORMAL, 0.0, absmax)
    inverse = torch.where(scales == 0, 0.0, torch.ones_like(scales) / scales)
    return scales, inverse


def _scaled_magnitudes(blocks: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    y = blocks.abs() * inverse[:, None]
    return torch.where(y < 1.0, y, 1.0)


def quantize_m(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Signed E4M3 codes uint8 [n] and fp32 scales [ceil(n / block_size)] of a first moment."""
    blocks, n = _blocks(x, block_size)
    scales, inverse = _block_scales(blocks)
    magnitude = encode_magnitude(_scaled_magnitudes(blocks, inverse), M_MANTISSA_BITS)
    codes = torch.where(blocks < 0, magnitude | _SIGN_CODE_BIT, magnitude)
    return codes.reshape(-1)[:n].to(torch.uint8), scales


def dequantize_m(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 [n] first moment from `quantize_m` codes and scales."""
    flat = codes.reshape(-1).to(torch.int32)
    magnitude = decode_magnitude(flat & (_SIGN_CODE_BIT - 1), M_MANTISSA_BITS)
    signed = torch.where(flat >= _SIGN_CODE_BIT, -magnitude, magnitude)
    return signed * _expand_scales(scales, block_size, flat.numel())


def quantize_s(s: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsigned E4M4 codes uint8 [n] and fp32 scales of s = sqrt(second moment) >= 0."""
    blocks, n = _blocks(s, block_size)
    scales, inverse = _block_scales(blocks)
    codes = encode_magnitude(_scaled_magnitudes(blocks, inverse), S_MANTISSA_BITS)
    return codes.reshape(-1)[:n].to(torch.uint8), scales


def dequantize_s(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """fp32 [n] s = sqrt(second moment) from `quantize_s` codes and scales."""
    flat = codes.reshape(-1).to(torch.int32)
    magnitude = decode_magnitude(flat, S_MANTISSA_BITS)
    return magnitude * _expand_scales(scales, block_size, flat.numel())


@dataclass(frozen=True)
class _Scalars:
    """The step's scalar arguments as fp32 0-dim tensors, each rounded from double once."""

    beta1: torch.Tensor
    beta2: torch.Tensor
    one_minus_beta1: torch.Tensor
    one_minus_beta2: torch.Tensor
    eps: torch.Tensor
    step_size: torch.Tensor
    inv_sqrt_bias_correction2: torch.Tensor
    decay_factor: torch.Tensor
    l2_weight_decay: torch.Tensor
    grad_scale: torch.Tensor


def _scalars(device, beta1, beta2, eps, step_size, inv_sqrt_bias_correction2, decay_factor,
             l2_weight_decay, grad_scale) -> _Scalars:
    def fp32(value: float) -> torch.Tensor:
        return torch.tensor(float(value), dtype=torch.float32, device=device)

    return _Scalars(fp32(beta1), fp32(beta2), fp32(1.0 - beta1), fp32(1.0 - beta2), fp32(eps),
                    fp32(step_size), fp32(inv_sqrt_bias_correction2), fp32(decay_factor),
                    fp32(l2_weight_decay), fp32(grad_scale))


def _correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 sqrt (what the kernels compute): torch.sqrt on fp32 CPU tensors is not correctly
    rounded (about 15% of results 1 ulp off with torch 2.13), while the float64 root of an fp32
    value, rounded to fp32, is (53 >= 2 * 24 + 2 bits, so the double rounding is harmless)."""
    return torch.sqrt(x.to(torch.float64)).to(torch.float32)


def _element_step(param, grad, m_hat, v_hat, k: _Scalars):
    """New (param, m, v, s) of every element, in the module docstring's order of operations."""
    g = grad * k.grad_scale
    g = g + k.l2_weight_decay * param
    m = k.beta1 * m_hat + k.one_minus_beta1 * g
    v = k.beta2 * v_hat + k.one_minus_beta2 * (g * g)
    s = _correctly_rounded_sqrt(v)
    denom = s * k.inv_sqrt_bias_correction2 + k.eps
    decayed = param * k.decay_factor
    return decayed - k.step_size * (m / denom), m, v, s


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
    """One Adam/AdamW step on fp32 `param` [n] with 8-bit states, all updated in place.

    m_codes / v_codes: uint8 [n] (`quantize_m` / `quantize_s` codes of m and sqrt(v));
    m_scales / v_scales: fp32 [ceil(n / block_size)]. Scalars: see the module docstring.
    """
    k = _scalars(param.device, beta1, beta2, eps, step_size, inv_sqrt_bias_correction2,
                 decay_factor, l2_weight_decay, grad_scale)
    flat_param = param.view(-1)
    m_hat = dequantize_m(m_codes, m_scales, block_size)
    s_hat = dequantize_s(v_codes, v_scales, block_size)
    new_param, m, _, s = _element_step(flat_param, grad.reshape(-1), m_hat, s_hat * s_hat, k)
    flat_param.copy_(new_param)
    for codes, scales, (new_codes, new_scales) in (
        (m_codes, m_scales, quantize_m(m, block_size)),
        (v_codes, v_scales, quantize_s(s, block_size)),
    ):
        codes.view(-1).copy_(new_codes)
        scales.view(-1).copy_(new_scales)


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
    """One Adam/AdamW step on fp32 `param` with fp32 states m and v (not sqrt(v)), in place."""
    k = _scalars(param.device, beta1, beta2, eps, step_size, inv_sqrt_bias_correction2,
                 decay_factor, l2_weight_decay, grad_scale)
    flat_m, flat_v = m.view(-1), v.view(-1)
    new_param, new_m, new_v, _ = _element_step(param.view(-1), grad.reshape(-1), flat_m, flat_v, k)
    param.view(-1).copy_(new_param)
    flat_m.copy_(new_m)
    flat_v.copy_(new_v)


def sum_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim float64 sum of x * x over every element of every tensor (fp32 / bf16 / fp16).

    Each element is converted to fp32 and squared in fp32; squares are summed in fp32 within chunks
    of 4096 consecutive elements of one tensor, and the chunk sums in float64. NaN and Inf are
    never masked. An empty list gives 0 on the CPU.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64, device=tensors[0].device)
    for tensor in tensors:
        chunks, _ = _blocks(tensor, SUM_SQUARES_CHUNK)
        total = total + (chunks * chunks).sum(dim=1).to(torch.float64).sum()
    return total
