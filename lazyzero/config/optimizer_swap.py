"""How many pool buffers DeepSpeed's NVMe optimizer swappers need, for the config check and the
swappers themselves (lazyzero/optimizer/nvme_swap_pipelined.py).

Each buffer holds the fp32 partition of the largest swapped sub-group. The partitioned (default)
swapper steps one sub-group at a time and waits for every read and write. The pipelined one
(`pipeline_read` / `pipeline_write`) has up to three operations in flight: the sub-group stepping,
the next one being read and the previous one being written. Each operation holds a buffer per fp32
state tensor and one for the gradient: four for a sub-group with fp32 Adam moments (master and two
moments), three for one with lazyzero's 8-bit states (master and the packed state). A run with the
8-bit optimizer has both kinds: the tensors `fraction_8bit` leaves out keep fp32 moments
(lazyzero/optimizer/state_policy.py), wherever they are placed.
"""

from __future__ import annotations

# DeepSpeed's default `offload_optimizer.buffer_count`.
PARTITIONED_BUFFER_COUNT = 4
PIPELINED_OPERATIONS_IN_FLIGHT = 3
# The fp32 master and two Adam moments, and the gradient: the larger of the two kinds above.
BUFFERS_PER_OPERATION = 4


def pipelined_buffer_count() -> int:
    """Pool buffers the pipelined swapper needs for Adam's sub-groups of either state precision."""
    return PIPELINED_OPERATIONS_IN_FLIGHT * BUFFERS_PER_OPERATION


def is_pipelined(offload_optimizer: dict) -> bool:
    return offload_optimizer.get("pipeline_read") is True or offload_optimizer.get("pipeline_write") is True
