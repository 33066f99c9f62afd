"""The `lazyzero.gradients` config section and its checks against the DeepSpeed settings around it.

A capability's section module is on the foundation layer (docs/architecture.md, "The layering rule"):
it imports only `lazyzero.config` helpers, so that `lazyzero.config` composes it into `LazyZeroConfig`
and validating a config imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from lazyzero.config.errors import Problem
from lazyzero.config.fieldtypes import PowerOfTwo
from lazyzero.config.section import ConfigSection


class GradientsConfig(ConfigSection):
    """Gradient reduce-scatter as an int8 all-to-all followed by a local dequantize-and-sum."""

    retired_keys = {"quantize": "use lazyzero.gradients.enabled: true (int8 is the wire format)"}

    enabled: bool = False
    """Send gradients in int8 in the reduce-scatter; false keeps DeepSpeed's own collective."""

    # 256 values per fp32 scale adds 4/256 = 1.6% to the traffic while the error bound (half a
    # block's scale, docs/reliability.md, what is tested) stays local; 2048 would save only 1.4% more bandwidth but
    # let a single outlier coarsen eight times as many values.
    block_size: PowerOfTwo(32, 8192) = 256
    """Gradient elements sharing one fp32 scale."""

    stochastic_rounding: bool = False
    """Round to a neighbouring code at random (unbiased) instead of to the nearest one."""

    seed: int = Field(0, ge=0)
    """Seed of the stochastic rounding noise, combined with rank and step."""

    error_feedback: bool = False
    """Add each rank's quantization error of one step to its gradient of the next step."""

    ranks_per_node: Optional[int] = Field(None, ge=1)
    """Ranks per node for the two-hop layout (inside nodes first, then across). null: from the launcher."""


def gradients_problems(gradients: GradientsConfig, ds_config: dict, world_size: Optional[int]) -> list[Problem]:
    """Settings of the section that contradict DeepSpeed's ZeRO settings, or the world size."""
    problems = []
    zero = ds_config.get("zero_optimization")
    if gradients.enabled and isinstance(zero, dict) and zero.get("zero_quantized_gradients") is True:
        problems.append(Problem.conflict(
            "lazyzero.gradients.enabled", True, "false while zero_optimization.zero_quantized_gradients is true",
            "ZeRO++ qgZ would quantize the same gradients a second time"))
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if (gradients.enabled and stage in (1, 2)
            and isinstance(zero, dict) and zero.get("contiguous_gradients", True) is False):
        problems.append(Problem.conflict(
            "lazyzero.gradients.enabled", True,
            "false while zero_optimization.contiguous_gradients is false on stage 1 or 2",
            "without a contiguous bucket DeepSpeed reduces in full precision through a path int8 does not replace"))
    if gradients.error_feedback and not gradients.enabled:
        problems.append(Problem.bad_value(
            "lazyzero.gradients.error_feedback", True,
            "false while lazyzero.gradients.enabled is false (it carries the int8 rounding error)"))
    ranks_per_node = gradients.ranks_per_node
    if ranks_per_node is not None and world_size is not None and world_size % ranks_per_node:
        problems.append(Problem.bad_value(
            "lazyzero.gradients.ranks_per_node", ranks_per_node,
            f"a divisor of the world size {world_size} (the two-hop layout needs whole nodes)"))
    return problems
