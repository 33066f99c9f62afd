"""RMSNorm over rows in one native call each way: op schemas, fake kernels and the Python API.

`rms_norm_rows` is transformers' RMSNorm (LlamaRMSNorm and its copies) and `rms_norm_rows_backward`
its gradients in closed form from the input alone; `lazyzero.ops.norms_reference` specifies both.
Kernels: csrc/norms/rms_norm_cpu.cpp (C++ with OpenMP) and csrc/norms/rms_norm_cuda.cu, attached when
`lazyzero.ops.native_build` loads the native libraries. On a GPU each op is one kernel launch, and
the weight's gradient one more (a reduction of per-block partial sums).
"""

from __future__ import annotations

import torch

from lazyzero.ops import norms_reference
from lazyzero.ops.native_build import ensure_native
from lazyzero.ops.quant import run_counted

_SCHEMAS = {
    "rms_norm_rows": "(Tensor x, Tensor weight, float eps) -> Tensor",
    "rms_norm_rows_backward": (
        "(Tensor x, Tensor grad_y, Tensor weight, float eps, bool wants_x, bool wants_weight)"
        " -> (Tensor grad_x, Tensor grad_weight)"
    ),
}

for _name, _schema in _SCHEMAS.items():
    torch.library.define(f"lazyzero::{_name}", _schema)


@torch.library.register_fake("lazyzero::rms_norm_rows")
def _rms_norm_rows_fake(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.result_type(weight, x))


@torch.library.register_fake("lazyzero::rms_norm_rows_backward")
def _rms_norm_rows_backward_fake(x, grad_y, weight, eps, wants_x, wants_weight):
    return (x.new_empty(x.shape) if wants_x else x.new_empty(0),
            weight.new_empty(weight.shape) if wants_weight else weight.new_empty(0))


def native_available(device: torch.device) -> bool:
    """Whether the native norm kernels run on `device` (builds them on first use; raises on a GPU where
    they cannot be built, as every native op does)."""
    return ensure_native(device.type)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) rounded to x's dtype, over x's last dimension."""
    return run_counted(norms_reference, "rms_norm_rows", x.device, x, weight, float(eps))


def rms_norm_rows_backward(x: torch.Tensor, grad_y: torch.Tensor, weight: torch.Tensor, eps: float,
                           wants_x: bool = True, wants_weight: bool = True):
    """(grad of x, grad of weight) of `rms_norm_rows` from x alone, None where not wanted."""
    grad_y = grad_y.to(torch.result_type(weight, x))  # autograd gives the output's dtype already
    grad_x, grad_weight = run_counted(norms_reference, "rms_norm_rows_backward", x.device, x, grad_y, weight,
                                      float(eps), wants_x, wants_weight)
    return grad_x if wants_x else None, grad_weight if wants_weight else None
