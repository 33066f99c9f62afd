"""Which parameters get 8-bit optimizer states: the hybrid policy of `"lazyzero": {"optimizer"}`.

A parameter keeps fp32 moments when its name matches one of `fp32_patterns` (embeddings and norms
by default: few elements, sensitive to quantization) or when it has fewer than `min_8bit_size`
elements. Of the rest, `fraction_8bit` (set by hand or by the planner) picks the largest tensors
first until that fraction of their elements is covered. The result is two parameter groups per
input group, which ZeRO keeps apart, so each group's flat partition has one state precision.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch

from lazyzero.optimizer.config import OptimizerConfig


@dataclass
class StatePrecisionPlan:
    """The policy's choice, by parameter name, with element counts for the run report."""

    eight_bit: list[str] = field(default_factory=list)
    fp32: list[str] = field(default_factory=list)
    eight_bit_elements: int = 0
    fp32_elements: int = 0

    def summary(self) -> str:
        total = max(1, self.eight_bit_elements + self.fp32_elements)
        return (f"8-bit Adam states for {len(self.eight_bit)} tensors ({self.eight_bit_elements / 1e6:.2f}M "
                f"elements, {100 * self.eight_bit_elements / total:.1f}%), fp32 for {len(self.fp32)} tensors "
                f"({self.fp32_elements / 1e6:.2f}M elements)")


def choose_state_precision(named_parameters: list[tuple[str, torch.Tensor]],
                           config: OptimizerConfig) -> StatePrecisionPlan:
    eligible, plan = [], StatePrecisionPlan()
    for name, param in named_parameters:
        numel = _full_numel(param)
        if any(fnmatch.fnmatch(name, pattern) for pattern in config.fp32_patterns) or numel < config.min_8bit_size:
            plan.fp32.append(name)
            plan.fp32_elements += numel
        else:
            eligible.append((numel, name))
    eligible.sort(key=lambda item: (-item[0], item[1]))
    wanted = sum(numel for numel, _ in eligible) * (1.0 if config.fraction_8bit is None else config.fraction_8bit)
    for numel, name in eligible:
        if plan.eight_bit_elements < wanted:
            plan.eight_bit.append(name)
            plan.eight_bit_elements += numel
        else:
            plan.fp32.append(name)
            plan.fp32_elements += numel
    return plan


def split_param_groups(model: torch.nn.Module, model_parameters, plan: StatePrecisionPlan) -> list[dict]:
    """The optimizer's parameter groups: each input group split into its 8-bit and fp32 parts.

    `model_parameters` is what the user gave DeepSpeed (parameters, groups, or None for all of the
    model's trainable parameters); names come from `model.named_parameters()`.
    """
    names = {id(param): name for name, param in model.named_parameters()}
    eight_bit = set(plan.eight_bit)
    groups = []
    for group in _as_groups(model, model_parameters):
        params = list(group["params"])
        options = {key: value for key, value in group.items() if key != "params"}
        for bits in (8, 32):
            chosen = [param for param in params if (names.get(id(param)) in eight_bit) == (bits == 8)]
            if chosen:
                groups.append({**options, "params": chosen, "state_bits": bits})
    return groups


def _as_groups(model: torch.nn.Module, model_parameters) -> list[dict]:
    if model_parameters is None:
        return [{"params": [param for param in model.parameters() if param.requires_grad]}]
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return items
    return [{"params": items}]


def _full_numel(param: torch.Tensor) -> int:
    # Under zero.Init a parameter is already partitioned; ds_numel is its full size.
    return int(getattr(param, "ds_numel", param.numel()))
