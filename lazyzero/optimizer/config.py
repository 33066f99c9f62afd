"""The `lazyzero.optimizer` config section and its checks against the DeepSpeed settings around it.

A capability's section module is on the foundation layer (docs/architecture.md, "The layering rule"):
it imports only `lazyzero.config` helpers, so that `lazyzero.config` composes it into `LazyZeroConfig`
and validating a config imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from lazyzero.config.errors import Problem
from lazyzero.config.fieldtypes import NonEmptyStr, PowerOfTwo
from lazyzero.config.optimizer_swap import (
    PARTITIONED_BUFFER_COUNT,
    PIPELINED_OPERATIONS_IN_FLIGHT,
    is_pipelined,
    pipelined_buffer_count,
)
from lazyzero.config.section import ConfigSection

# DeepSpeed compares optimizer names lowercased (deepspeed/runtime/config.py).
ADAM_FAMILY = ("adam", "adamw")


class OptimizerConfig(ConfigSection):
    """8-bit Adam/AdamW: optimizer states stored block-wise in 8 bits, with a fused step."""

    retired_values = {"type": {"none": "switch the 8-bit optimizer off with lazyzero.optimizer.enabled: false"}}
    planned_fields = ("enabled", "type", "fraction_8bit")

    enabled: bool = False
    """Replace DeepSpeed's Adam or AdamW (hyper-parameters from its "optimizer" section) by the 8-bit `type`; false
    keeps it."""

    type: Literal["adamw8bit", "adam8bit"] = "adamw8bit"
    """The 8-bit optimizer: "adamw8bit" (decoupled weight decay, as AdamW) or "adam8bit" (L2 decay, as Adam)."""

    block_size: PowerOfTwo(32, 4096) = 256
    """State elements sharing one scale."""

    min_8bit_size: int = Field(4096, ge=0)
    """Parameters with fewer elements keep fp32 states (the scales would outweigh the saving)."""

    fp32_patterns: list[NonEmptyStr] = Field(default_factory=lambda: ["*embed*", "*norm*"])
    """Parameter-name glob patterns (fnmatch) whose states stay fp32; embeddings and norms are sensitive to
    quantization."""

    fraction_8bit: Optional[float] = Field(None, ge=0, le=1)
    """Fraction of the eligible parameters' elements given 8-bit states, largest tensors first. null: all."""

    fused_clipping: bool = True
    """Compute the gradient norm and clip inside the fused step instead of in a separate pass."""


def optimizer_problems(optimizer: OptimizerConfig, ds_config: dict) -> list[Problem]:
    """DeepSpeed settings the 8-bit optimizer contradicts: an optimizer other than Adam or AdamW,
    fp32-shaped state re-splits, too few pipelined swap buffers."""
    if not optimizer.enabled:
        return []
    problems = [Problem.conflict("lazyzero.optimizer.enabled", True, f"false while {setting} is {value}", why)
                for setting, value, why in _eight_bit_state_blockers(ds_config)]
    problems += _pipelined_swap_buffer_problems(ds_config)
    ds_optimizer = ds_config.get("optimizer")
    if not isinstance(ds_optimizer, dict) or "type" not in ds_optimizer:
        # Without an "optimizer" section the optimizer comes from code; the engine checks it there.
        return problems
    ds_type = ds_optimizer["type"]
    if not (isinstance(ds_type, str) and ds_type.lower() in ADAM_FAMILY):
        problems.append(Problem.conflict(
            "lazyzero.optimizer.enabled", True, "false unless optimizer.type is Adam or AdamW",
            f"optimizer.type is {ds_type!r}; the 8-bit optimizers replace Adam or AdamW and take their "
            "hyper-parameters"))
    return problems


def _pipelined_swap_buffer_problems(ds_config: dict) -> list[Problem]:
    """The pipelined swapper holds up to three operations of four buffers each
    (lazyzero/config/optimizer_swap.py); too few stop the first step with an assertion."""
    zero = ds_config.get("zero_optimization")
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    if not (isinstance(offload, dict) and offload.get("device") == "nvme" and is_pipelined(offload)):
        return []
    count, needed = offload.get("buffer_count", PARTITIONED_BUFFER_COUNT), pipelined_buffer_count()
    if not isinstance(count, int) or count >= needed:
        return []
    return [Problem.conflict(
        "zero_optimization.offload_optimizer.buffer_count", count,
        f"at least {needed} while pipeline_read or pipeline_write is true and lazyzero.optimizer is enabled",
        f"up to {PIPELINED_OPERATIONS_IN_FLIGHT} swap operations are in flight, each holding a sub-group's fp32 "
        "master, its gradient and its moments (fp32, or 8-bit packed in one buffer)")]


def _eight_bit_state_blockers(ds_config: dict) -> list[tuple[str, str, str]]:
    """DeepSpeed settings that would move or reshape optimizer states as fp32 tensors of the
    partition's size, which 8-bit codes and per-block scales are not: (setting, value, why)."""
    zero = ds_config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    blockers = []
    if zero.get("elastic_checkpoint") is True:
        blockers.append(("zero_optimization.elastic_checkpoint", "true",
                         "elastic checkpoints re-split optimizer states as fp32 partition slices; 8-bit states are "
                         "saved per rank and reload on the same number of ranks"))
    checkpoint = ds_config.get("checkpoint")
    if isinstance(checkpoint, dict) and checkpoint.get("load_universal") is True:
        blockers.append(("checkpoint.load_universal", "true",
                         "universal checkpoints hold fp32 exp_avg/exp_avg_sq per parameter, not 8-bit states"))
    return blockers
