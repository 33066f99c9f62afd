"""Pure-PyTorch reference of the RMSNorm ops (`lazyzero.ops.norms`): transformers' RMSNorm and its
gradients in closed form, over rows (x's last dimension).

Assumptions: x is [..., width] in fp32, bf16 or fp16; weight is [width]; grad_y has x's shape and the
output's dtype. Everything inside is fp32. Rounding points, which the kernels keep:

- forward: y = w * x̂ rounded to x's dtype, x̂ = x * r, r = rsqrt(mean(x^2) + eps); the product in
  the dtype torch promotes w and x to (transformers' LlamaRMSNorm, Qwen2's, Mistral's);
- backward: with g = dy * w rounded to the output's dtype (as autograd through that norm rounds it),
  dx = r * (g - x̂ * mean(g * x̂)) in x's dtype, and dw = the sum over rows of dy * x̂ in fp32, in
  the weight's dtype. A gradient not wanted is an empty tensor.

The kernels sum each row in another order (in double on the CPU, in a tree on CUDA): they agree with
this to fp32 rounding, which a rounding to bf16 can turn into one bf16 ulp.
"""

from __future__ import annotations

import torch


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normalized = x.float()
    normalized = normalized * torch.rsqrt(normalized.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalized.to(x.dtype)


def rms_norm_rows_gradients(rows_x: torch.Tensor, rows_grad: torch.Tensor, weight: torch.Tensor, eps: float,
                            wants_x: bool, wants_weight: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx in x's dtype, dw as an fp32 sum over these rows), None where not wanted, for 2-D rows."""
    normalized = rows_x.float()
    rstd = normalized.square().mean(-1, keepdim=True).add_(eps).rsqrt_()
    normalized.mul_(rstd)
    weight_sum = (rows_grad.float() * normalized).sum(0) if wants_weight else None
    if not wants_x:
        return None, weight_sum
    scaled = (rows_grad * weight).float()
    mean = (scaled * normalized).mean(-1, keepdim=True)
    return scaled.sub_(normalized.mul_(mean)).mul_(rstd).to(rows_x.dtype), weight_sum


def rms_norm_rows_backward(x: torch.Tensor, grad_y: torch.Tensor, weight: torch.Tensor, eps: float,
                           wants_x: bool, wants_weight: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = x.shape[-1]
    grad_x, weight_sum = rms_norm_rows_gradients(x.reshape(-1, width), grad_y.reshape(-1, width), weight, eps,
                                                 wants_x, wants_weight)
    grad_x = grad_x.reshape(x.shape) if wants_x else x.new_empty(0)
    return grad_x, weight_sum.to(weight.dtype) if wants_weight else weight.new_empty(0)
