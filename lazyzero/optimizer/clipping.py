"""Fused global-norm gradient clipping for DeepSpeed's ZeRO optimizers and the stage-0 engine.

DeepSpeed computes the norm with one small reduction per parameter, then multiplies every
gradient by the clip factor in a separate pass. Here, on the device, the norm is one fused pass
over each rank's gradient partition (`lazyzero.ops.sum_squares`: fp32 within chunks, fp64
across). Under optimizer offload DeepSpeed already takes each parameter's norm while it copies the
gradient to the host buffer, on the device, so those recorded norms are summed instead of reading
the host buffer again (DeepSpeed itself sums them with one host sync per parameter and one
reduction per sub-group). Either way the squares are reduced across ranks once, in fp64, and the
factor goes to the 8-bit optimizer as `grad_scale`, applied inside its fused step.
A non-finite norm sets `grad_scale` to NaN, which the optimizer treats as "skip this step" on every
rank (the norm is the same everywhere after the reduction).
The replacements are installed on one optimizer object through `lazyzero.patch_point`.
"""

from __future__ import annotations

import math
from typing import Iterable

import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator

from lazyzero.ops import adam8bit as kernels
from lazyzero.patch_point import replace_method

SKIP_STEP = float("nan")
# DeepSpeed's clip formula adds 1e-6 to the norm before dividing; kept so clipped steps match it.
CLIP_EPSILON = 1e-6
_OWNER = "lazyzero.optimizer (fused clipping)"
# Why the fused ZeRO-3 norm may hide TieredZeroOptimizer_Stage3._get_norm_groups (plan/deepspeed/zero_placement.py).
_OVER_TIERED_NORM = (
    "the override only puts DeepSpeed's per-sub-group norms back in the parameters' own order before they "
    "are combined; the fused norm (_stage_3_norm) takes no per-sub-group norms: it sums every parameter's "
    "gradient partition (or, under offload, its recorded norm) in the parameters' own order already")


def global_grad_norm(gradients: Iterable[torch.Tensor | None], group=None, reduce: bool = True) -> torch.Tensor:
    """sqrt of the sum of squares of this rank's gradients, summed over `group` when `reduce`
    (ranks holding disjoint partitions); a 0-dim fp64 tensor."""
    present = [grad for grad in gradients if grad is not None and grad.numel() > 0]
    device = present[0].device if present else torch.device("cpu")
    local = kernels.sum_squares(present) if present else torch.zeros((), dtype=torch.float64, device=device)
    return _root_of_sum_over_ranks(local, group) if reduce and dist.is_initialized() else local.sqrt()


def grad_scale_for(total_norm, loss_scale: float, clip_grad: float) -> float:
    """What every gradient is multiplied by: 1/loss_scale, times the clip factor when clipping.

    `total_norm` is the norm of the still loss-scaled gradients, as DeepSpeed passes it. NaN (skip)
    when the norm is not finite.
    """
    norm = float(total_norm) if total_norm is not None else 0.0
    if not math.isfinite(norm) or norm < 0:
        return SKIP_STEP
    combined = float(loss_scale)
    if clip_grad > 0.0:
        clip = max(((norm / loss_scale) + CLIP_EPSILON) / clip_grad, 1.0)
        combined = clip * loss_scale
    return 1.0 / combined


def norm_from_offload_copies(zero_optimizer, params: Iterable[torch.Tensor], group) -> torch.Tensor:
    """The global norm from the per-parameter norms DeepSpeed recorded while offloading gradients
    (`norm_for_param_grads`: the norm of this rank's part of each parameter's gradient)."""
    recorded = zero_optimizer.norm_for_param_grads
    squares = [recorded[key].double() ** 2 for key in (zero_optimizer.get_param_id(p) for p in params)
               if key in recorded]
    # The norms were taken on the accelerator, where the reduction runs too.
    device = get_accelerator().current_device_name()
    local = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=device)
    return _root_of_sum_over_ranks(local, group)


def _root_of_sum_over_ranks(local_sum_of_squares: torch.Tensor, group) -> torch.Tensor:
    """The one cross-rank reduction of a norm: fp64 sum of every rank's squares, then the root."""
    if dist.get_world_size(group=group) > 1:
        dist.all_reduce(local_sum_of_squares, op=dist.ReduceOp.SUM, group=group)
    return local_sum_of_squares.sqrt()


def _set_grad_scale(zero_optimizer, scale: float) -> None:
    for name in ("optimizer", "backup_optimizer"):
        inner = getattr(zero_optimizer, name, None)
        if inner is not None and hasattr(inner, "grad_scale"):
            inner.grad_scale = scale


def _stage_1_2_norm(zero_optimizer) -> torch.Tensor:
    groups = range(len(zero_optimizer.bit16_groups))
    if zero_optimizer.cpu_offload:
        params = [p for index in groups for p in zero_optimizer.params_in_partition[index]]
        return norm_from_offload_copies(zero_optimizer, params, zero_optimizer.dp_process_group)
    gradients = [grad for index in groups for grad in (zero_optimizer.averaged_gradients.get(index) or [])]
    return global_grad_norm(gradients, group=zero_optimizer.dp_process_group)


def _stage_3_norm(zero_optimizer) -> torch.Tensor:
    # The parameters' own order, not the sub-groups': per-layer NVMe placement (zero_placement.py)
    # reorders sub-groups, and an fp64 sum in another order can differ in the last bit. Without a
    # placement both orders are the same.
    params = [p for group in zero_optimizer.trainable_param_groups for p in group["params"]]
    if zero_optimizer.offload_optimizer:
        return norm_from_offload_copies(zero_optimizer, params, zero_optimizer.dp_process_group)
    partitions = _gradient_partitions_by_parameter(zero_optimizer)
    return global_grad_norm([partitions.get(id(p)) for p in params], group=zero_optimizer.dp_process_group)


def _gradient_partitions_by_parameter(zero_optimizer) -> dict[int, torch.Tensor]:
    """This rank's reduced gradient partition of each parameter, by id (DeepSpeed keeps them per
    sub-group in `averaged_gradients`, aligned with `fp16_groups`)."""
    return {id(param): grad for index, grads in zero_optimizer.averaged_gradients.items()
            for param, grad in zip(zero_optimizer.fp16_groups[index], grads or [])}


def install_on_stage_1_2(zero_optimizer) -> None:
    """Replace the norm and the clip pass of a DeepSpeedZeroOptimizer (stages 1 and 2)."""

    def scaled_global_norm(norm_type=2):
        assert norm_type == 2, "only the L2 norm is supported"
        return _stage_1_2_norm(zero_optimizer)

    def unscale_and_clip_grads(grad_groups_flat, total_norm):
        scale = grad_scale_for(total_norm, zero_optimizer.loss_scale, zero_optimizer.clip_grad)
        _set_grad_scale(zero_optimizer, scale)
        if not math.isfinite(scale) and (zero_optimizer.dtype != torch.bfloat16 or zero_optimizer.check_grad_overflow):
            # Where DeepSpeed 0.19.8 skips a non-finite norm itself before this call (0.19.7 does not):
            # the engine reads `overflow` after the step, counts it skipped and holds the LR.
            zero_optimizer.overflow = True

    replace_method(zero_optimizer, "scaled_global_norm", scaled_global_norm, owner=_OWNER)
    replace_method(zero_optimizer, "unscale_and_clip_grads", unscale_and_clip_grads, owner=_OWNER)


def install_on_stage_3(zero_optimizer) -> None:
    """Replace the norm and the clip pass of DeepSpeedZeroOptimizer_Stage3."""

    def get_norm_groups():
        return [_stage_3_norm(zero_optimizer)]

    def unscale_and_clip_grads(sub_group_id, total_norm):
        scale = grad_scale_for(total_norm, zero_optimizer.loss_scale, zero_optimizer.clip_grad)
        _set_grad_scale(zero_optimizer, scale)
        if not math.isfinite(scale):
            # DeepSpeed 0.19.8 skips a non-finite norm before this call; 0.19.7 checks only fp16
            # overflow. The engine reads `overflow` after the step, counts it skipped, holds the LR.
            zero_optimizer.overflow = True

    replace_method(zero_optimizer, "_get_norm_groups", get_norm_groups, owner=_OWNER, over_override=_OVER_TIERED_NORM)
    replace_method(zero_optimizer, "unscale_and_clip_grads", unscale_and_clip_grads, owner=_OWNER)
