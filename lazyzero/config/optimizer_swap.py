"""How many pool buffers DeepSpeed's NVMe optimizer swappers need, for the config check, the planner
and the swappers themselves (lazyzero/optimizer/nvme_swap_pipelined.py).

Each buffer holds the fp32 partition of the largest swapped sub-group. The partitioned (default)
swapper steps one sub-group at a time and waits for every read and write. The pipelined one
(`pipeline_read` / `pipeline_write`) has up to three operations in flight: the sub-group stepping,
the next one being read and the previous one being written. Each operation holds a buffer per fp32
state tensor, one for the gradient and, for lazyzero's 8-bit states, one for the packed state.
"""

from __future__ import annotations

# DeepSpeed's default `offload_optimizer.buffer_count`.
PARTITIONED_BUFFER_COUNT = 4
PIPELINED_OPERATIONS_IN_FLIGHT = 3
# The fp32 master alone: the 8-bit moments travel packed in a buffer of their own.
EIGHT_BIT_STATE_TENSORS = 1


def pipelined_buffer_count(state_tensors: int = EIGHT_BIT_STATE_TENSORS, packed: bool = True) -> int:
    """Pool buffers the pipelined swapper needs when each swapped sub-group has `state_tensors` fp32
    tensors (the master; plus two moments where a group keeps fp32 Adam states), with a packed 8-bit
    state buffer per operation where `packed`."""
    return PIPELINED_OPERATIONS_IN_FLIGHT * (state_tensors + 1 + int(packed))


def is_pipelined(offload_optimizer: dict) -> bool:
    return offload_optimizer.get("pipeline_read") is True or offload_optimizer.get("pipeline_write") is True
