"""`Adam8bit` / `AdamW8bit`: Adam with block-wise 8-bit moments and one fused step per tensor.

Each parameter group chooses its state precision (`state_bits`: 8 or 32). With 8 bits, the first
moment is stored as signed minifloat codes and the second as unsigned codes of its square root, one
fp32 scale per `block_size` elements (lazyzero/ops/adam8bit_reference.py defines the codes): about
2.03 bytes per parameter instead of 8. Tensors smaller than `min_8bit_size` keep fp32 moments,
where the per-block scales would eat the saving. Both precisions run one fused pass per tensor that
reads the gradient once, applies `grad_scale` (unscale and clip factor, set by the engine's fused
clipping), updates the moments and the parameter, and requantizes.

The arithmetic follows torch.optim.Adam/AdamW (bias corrections, eps added after the bias-corrected
square root; AdamW decays the parameter by lr*weight_decay before the update).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from lazyzero.ops import adam8bit as kernels

CODE_KEYS = ("m_codes", "sqrt_v_codes")
SCALE_KEYS = ("m_scales", "sqrt_v_scales")
EIGHT_BIT_KEYS = CODE_KEYS + SCALE_KEYS
FP32_KEYS = ("exp_avg", "exp_avg_sq")


def decode_moments(state: dict, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first moment and the square root of the second, flat fp32, from an 8-bit state."""
    return (kernels.dequantize_m(state["m_codes"], state["m_scales"], block_size),
            kernels.dequantize_s(state["sqrt_v_codes"], state["sqrt_v_scales"], block_size))


def encode_moments(m: torch.Tensor, sqrt_v: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
    """The 8-bit state entries (codes and scales) of a first moment and a second moment's root."""
    state = {}
    state["m_codes"], state["m_scales"] = kernels.quantize_m(m, block_size)
    state["sqrt_v_codes"], state["sqrt_v_scales"] = kernels.quantize_s(sqrt_v, block_size)
    return state


class Adam8bit(torch.optim.Optimizer):
    """Adam (L2 weight decay added to the gradient) with 8-bit block-wise moments."""

    decoupled_weight_decay = False

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, block_size: int = 256, state_bits: int = 8,
                 min_8bit_size: int = 4096):
        _check_hyperparameters(lr, betas, eps, weight_decay, block_size, state_bits)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, block_size=block_size,
                        state_bits=state_bits, min_8bit_size=min_8bit_size)
        super().__init__(params, defaults)
        # Multiplies every gradient in the next steps: loss unscale and clip factor in one scalar, so
        # clipping costs no pass of its own. The engine's fused clipping sets it before each step.
        self.grad_scale = 1.0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not math.isfinite(self.grad_scale):
            # The engine's fused clipping found a non-finite norm: every rank skips this step.
            return loss
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_one(param, group)
        return loss

    def _step_one(self, param: torch.Tensor, group: dict) -> None:
        _check_tensor(param)
        state = self.state[param]
        if not state:
            self._init_state(param, group, state)
        state["step"] += 1
        scalars = self._host_scalars(group, state["step"])
        grad = param.grad
        if grad.dtype != torch.float32:
            grad = grad.float()
        flat_param, flat_grad = param.view(-1), grad.contiguous().view(-1)
        if "m_codes" in state:
            kernels.adam8bit_step_(flat_param, flat_grad, state["m_codes"], state["m_scales"],
                                   state["sqrt_v_codes"], state["sqrt_v_scales"], group["block_size"], **scalars)
        else:
            kernels.adam32_step_(flat_param, flat_grad, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1),
                                 **scalars)

    def _host_scalars(self, group: dict, step: int) -> dict[str, float]:
        """Step-dependent scalars in double precision; the kernels round each to fp32 once."""
        beta1, beta2 = group["betas"]
        lr, weight_decay = group["lr"], group["weight_decay"]
        decoupled = self.decoupled_weight_decay
        return dict(beta1=beta1, beta2=beta2, eps=group["eps"],
                    step_size=lr / (1.0 - beta1 ** step),
                    inv_sqrt_bias_correction2=1.0 / math.sqrt(1.0 - beta2 ** step),
                    decay_factor=1.0 - lr * weight_decay if decoupled else 1.0,
                    l2_weight_decay=0.0 if decoupled else weight_decay,
                    grad_scale=float(self.grad_scale))

    @staticmethod
    def uses_8bit_state(param: torch.Tensor, group: dict) -> bool:
        return group["state_bits"] == 8 and param.numel() >= group["min_8bit_size"]

    def _init_state(self, param: torch.Tensor, group: dict, state: dict) -> None:
        state["step"] = 0
        if self.uses_8bit_state(param, group):
            numel, blocks = param.numel(), -(-param.numel() // group["block_size"])
            for codes, scales in (("m_codes", "m_scales"), ("sqrt_v_codes", "sqrt_v_scales")):
                state[codes] = torch.zeros(numel, dtype=torch.uint8, device=param.device)
                state[scales] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
        else:
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.contiguous_format)

    def dequantized_state(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The moments of `param` in fp32 (`exp_avg`, `exp_avg_sq`), as torch's Adam names them."""
        state, group = self.state[param], self._group_of(param)
        if "m_codes" not in state:
            return {key: state[key].clone() for key in FP32_KEYS}
        m, sqrt_v = decode_moments(state, group["block_size"])
        return {"exp_avg": m.view_as(param), "exp_avg_sq": (sqrt_v * sqrt_v).view_as(param)}

    def state_bytes(self) -> int:
        """Bytes of moment state held now (codes, scales, fp32 moments), without step counters."""
        total = 0
        for state in self.state.values():
            for key in EIGHT_BIT_KEYS + FP32_KEYS:
                if key in state:
                    total += state[key].numel() * state[key].element_size()
        return total

    def _group_of(self, param: torch.Tensor) -> dict:
        for group in self.param_groups:
            if any(candidate is param for candidate in group["params"]):
                return group
        raise KeyError("parameter is not managed by this optimizer")

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every loaded state tensor to its parameter's dtype (fp32 here); the codes go
        # back to uint8, exactly, since fp32 holds every integer 0..255.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in CODE_KEYS:
                if key in state:
                    state[key] = state[key].to(torch.uint8)


class AdamW8bit(Adam8bit):
    """AdamW (decoupled weight decay) with 8-bit block-wise moments."""

    decoupled_weight_decay = True

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, **kwargs: Any):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)


def _check_hyperparameters(lr, betas, eps, weight_decay, block_size, state_bits) -> None:
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
    if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
        raise ValueError(f"betas must be two values in [0, 1), got {betas}")
    if state_bits not in (8, 32):
        raise ValueError(f"state_bits must be 8 or 32, got {state_bits}")
    if block_size < 32 or block_size > 4096 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two in [32, 4096], got {block_size}")


def _check_tensor(param: torch.Tensor) -> None:
    if param.dtype != torch.float32 or not param.is_contiguous():
        raise ValueError(f"8-bit Adam updates contiguous fp32 parameters (ZeRO's fp32 master copies); got "
                         f"{param.dtype}, contiguous={param.is_contiguous()}")
