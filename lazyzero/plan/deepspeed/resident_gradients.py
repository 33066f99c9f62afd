"""Gradients of NVMe-placed optimizer state, stepped from host memory instead of a round trip to NVMe.

With its optimizer on NVMe, DeepSpeed 0.19.7-0.19.8's ZeRO-3 keeps every parameter's reduced
gradient partition in one flat host buffer in the gradient-accumulation dtype
(`grad_partitions_flat_buffer`, bf16 for a bf16 model), for the whole run. At the accumulation
boundary it widens each gradient of a swapped sub-group to fp32 and writes that copy to NVMe
(`_offload_grad_partition_at_boundary`), and the step reads it back into a swap buffer, waiting for
the read, before it can step the sub-group. The flat buffer still holds the same values when the step
runs: nothing writes it between the boundary and the next backward. So the write and the read move
bytes the host already has: 8 of the 20 bytes per parameter that a layer with its 8-bit state on
NVMe moves each step, 4 of them read while nothing else runs (docs/plan.md, "How it works", step 4;
the A/B that measured it: benchmarks/results/records/2026-12-04-planner-bench-runs.md).

`ResidentGradients`, mixed into the planner's stage-3 optimizer (zero_placement.py), records instead
where each gradient of a swapped sub-group lies in the flat buffer, and when the sub-group is swapped
in for its step fills the fp32 gradient from there, in the pool buffer DeepSpeed would have read it
into. Widening bf16 to fp32 is exact, so the step sees the bits DeepSpeed's own path gives it
(tests/plan/test_zero_placement.py). The planner prices no gradient NVMe traffic for such layers
(`Machine.nvme_grads_resident`).

Only where the gradient handed over is the flat buffer itself (a machine without a GPU: on CUDA it
is a device copy) and the swapper is DeepSpeed's partitioned one; elsewhere DeepSpeed's path runs
unchanged. A gradient written into a swapped sub-group from outside the step (DeepSpeed's
`safe_set_full_grad` family, Muon's momentum write-back) would not survive the round trip, so it is
refused, naming the call.
"""

from __future__ import annotations

import torch
from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper


class ResidentGradients:
    """Mixin for `DeepSpeedZeroOptimizer_Stage3` subclasses (placed before DeepSpeed's class)."""

    def __init__(self, *args, **kwargs):
        # sub-group -> offset in its fp32 partition -> that gradient's view of the flat buffer. Set
        # before DeepSpeed's constructor, which already swaps sub-groups in. Kept across steps, as
        # DeepSpeed keeps its gradient files: a parameter without a gradient in a step keeps the one
        # it had, in the flat buffer as in the file.
        self._resident_gradients: dict[int, dict[int, torch.Tensor]] = {}
        super().__init__(*args, **kwargs)

    def _offload_grad_partition_at_boundary(self, param, grad_buffer, offload_fp32_gradients, offload_fp32_offsets):
        sub_group, offset, _ = self.grad_position[self.get_param_id(param)]
        if not self._keeps_resident(sub_group, grad_buffer):
            return super()._offload_grad_partition_at_boundary(param, grad_buffer, offload_fp32_gradients,
                                                               offload_fp32_offsets)
        # The norm DeepSpeed records at this point for every offloaded gradient (clipping reads it).
        self.norm_for_param_grads[self.get_param_id(param)] = self._constant_buffered_norm2(grad_buffer)
        self._resident_gradients.setdefault(sub_group, {})[offset] = grad_buffer

    def _keeps_resident(self, sub_group: int, grad_buffer: torch.Tensor) -> bool:
        return (self.swap_optimizer and isinstance(self.optimizer_swapper, PartitionedOptimizerSwapper)
                and self._swappable_optimizer_subgroup(sub_group)
                and grad_buffer.untyped_storage().data_ptr()
                == self.grad_partitions_flat_buffer.untyped_storage().data_ptr())

    def _optimizer_states_and_gradient_swap_in(self, sub_group_id, timer_names=None):
        super()._optimizer_states_and_gradient_swap_in(sub_group_id, timer_names)
        views = self._resident_gradients.get(sub_group_id)
        if views:
            self._fill_fp32_gradient(sub_group_id, views)

    def _fill_fp32_gradient(self, sub_group_id: int, views: dict[int, torch.Tensor]) -> None:
        partition = self.fp32_partitioned_groups_flat[sub_group_id]
        if partition.grad is None:  # DeepSpeed read no gradient file: take the buffer it would have used
            swapper = self.optimizer_swapper
            buffers = swapper.swap_buffer_manager.allocate(num_elems=swapper._io_aligned_numel(partition.numel()),
                                                           count=1, dtype=partition.dtype)
            if buffers is None:
                raise RuntimeError("no free optimizer swap buffer for a gradient: raise "
                                   "zero_optimization.offload_optimizer.buffer_count")
            # Freed with the sub-group's other swap buffers (release_swap_buffers).
            swapper._get_param_swap_info(partition).swap_buffers.append(buffers[0])
            partition.grad = buffers[0].narrow(0, 0, partition.numel())
        for offset, view in views.items():
            partition.grad.narrow(0, offset, view.numel()).copy_(view)

    def _writeback_swap_state(self, sub_group_id, write_opt_state, write_gradients):
        if write_gradients and self._resident_gradients.get(sub_group_id):
            raise NotImplementedError(
                "a gradient written into an NVMe-placed optimizer sub-group from outside the step "
                "(DeepSpeed's safe_set_full_grad / set_full_grad family, Muon) is not kept by a planned run: "
                "its step reads the gradient from DeepSpeed's flat gradient partition "
                "(lazyzero/plan/deepspeed/resident_gradients.py)")
        return super()._writeback_swap_state(sub_group_id, write_opt_state, write_gradients)
