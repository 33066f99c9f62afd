"""Host memory DeepSpeed 0.19.8's NVMe swappers hold for as long as the engine lives (docs/plan.md).

Found on a planned run of a 103M-parameter bf16 Llama on 2 CPU ranks, by listing the live tensors
between two steps: 286 MB per rank that the planner did not count, all of it swap buffers allocated
when the engine is built and never freed:
- the optimizer swapper (`offload_optimizer: nvme`): `buffer_count` buffers of the largest ZeRO-3
  sub-group's partition, in fp32 (4 x 31.5 MB there);
- the parameter swapper (`offload_param: nvme`): its pool of `buffer_count` x `buffer_size` elements
  (51.9 MB) and the "partitioned swap buffer" it writes updated parameters from, sized from the
  largest sub-group's *whole* tensors (stage3.py passes `ds_numel`, not the partition: 31.5 MB).
Every size is rounded up to DeepSpeed's I/O alignment (1024 bytes x `intra_op_parallelism`).
"""

from __future__ import annotations

import math

# deepspeed/runtime/swap_tensor/utils.py: AIO_ALIGNED_BYTES.
AIO_ALIGNED_BYTES = 1024
FP32_BYTES = 4


def largest_sub_group_bound(sub_group_size: int, largest_tensor_partition: int, total_partition: int) -> int:
    """Partition elements of the largest ZeRO-3 sub-group, at most. DeepSpeed (stage3.py
    `_create_fp16_sub_groups`) adds tensors to a group until it reaches `sub_group_size`, so a group
    holds at most `sub_group_size - 1` plus one tensor; which tensors meet in one depends on the
    optimizer's parameter groups (lazyzero's 8-bit groups split a layer's matrices from its norms),
    hence the bound: 7,865,343 against 7,864,320 measured for the model above."""
    return min(total_partition, sub_group_size - 1 + largest_tensor_partition)


def aligned(numel: int, element_bytes: int, intra_op_parallelism: int = 1) -> int:
    alignment = AIO_ALIGNED_BYTES * intra_op_parallelism // element_bytes
    return math.ceil(numel / alignment) * alignment


def optimizer_swap_bytes(largest_group_numel: int, buffer_count: int) -> int:
    """The optimizer swapper's fp32 buffers."""
    return buffer_count * aligned(largest_group_numel, FP32_BYTES) * FP32_BYTES


def parameter_swap_bytes(*, buffer_count: int, buffer_size: int, largest_group_numel: int, world_size: int,
                         dtype_bytes: int) -> int:
    """The parameter swapper's pool and its partitioned swap buffer (whole tensors of the largest
    sub-group: about `world_size` times its partition)."""
    pool = buffer_count * aligned(buffer_size, dtype_bytes) * dtype_bytes
    partitioned = aligned(largest_group_numel * world_size, dtype_bytes) * dtype_bytes
    return pool + partitioned
