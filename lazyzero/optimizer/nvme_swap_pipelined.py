"""NVMe optimizer offload of the 8-bit Adam states, pipelined (ZeRO-3, `pipeline_read` /
`pipeline_write`).

DeepSpeed 0.19.8's pipelined swapper (`PipelinedOptimizerSwapper`) reads the next swapped sub-group
while one steps and waits for a sub-group's writes only when the next sub-group is written, so the
disk works while the host steps (docs/plan.md, Limits). Like its partitioned sibling it treats every
state tensor as fp32 of the partition's size. `EightBitPipelinedSwapper` adds the packed 8-bit state
of a sub-group (nvme_swap.py) to the same asynchronous operation as DeepSpeed's own tensors: one
more read or write on the operation's aio handle, one more pool buffer that the operation frees when
it is waited for. Files, layout and placeholders are those of `EightBitStateSwapper`, so a swap
folder written by one is read by the other.

Pool buffers: a sub-group with packed 8-bit states holds three per operation in flight (master,
gradient, packed state), one with fp32 moments four (lazyzero/config/optimizer_swap.py).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import SYNC_SWAP_IN, PipelinedOptimizerSwapper
from deepspeed.runtime.swap_tensor.utils import swap_out_tensors

from lazyzero.optimizer.nvme_swap import PackedStateSwapping


class EightBitPipelinedSwapper(PackedStateSwapping, PipelinedOptimizerSwapper):
    """DeepSpeed's pipelined optimizer swapper, with 8-bit states swapped packed at their size."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # ds_id of the fp32 partition -> the pool buffer its packed state is read into, from the
        # read's submission until the operation that writes it back takes it over.
        self._packed_buffers: dict[str, torch.Tensor] = {}

    def _swap_in_optimizer_state(self, aio_handle, parameter):
        operation = super()._swap_in_optimizer_state(aio_handle, parameter)
        if operation is None or not self._manages_packed_state(parameter):
            return operation
        # The step reads the state only after the operation is waited for.
        buffer = self._submit_packed_read(aio_handle, parameter)
        operation.num_ops += 1
        # Freed with the operation's buffers when a later write completes (or the state is dropped).
        operation.allocated_buffers.append(buffer)
        self._packed_buffers[self._id(parameter)] = buffer
        return operation

    def _swap_out_optimizer_state(self, aio_handle, parameter, swap_in_op):
        operation = super()._swap_out_optimizer_state(aio_handle, parameter, swap_in_op)
        if self._manages_packed_state(parameter):
            resident = self._packed_buffers.pop(self._id(parameter), None)
            buffer, packed = self._packed_state_in(parameter, resident)
            if resident is None:
                operation.allocated_buffers.append(buffer)
            swap_out_tensors(aio_handle, [packed], [self.packed_path(parameter)])
            operation.num_ops += 1
            self._leave_placeholders(parameter)
        # DeepSpeed's pipelined path leaves the fp32 tensors pointing into pool buffers that the
        # next operations reuse; its partitioned path empties them. The write reads the buffers
        # themselves, so emptying now is safe and a checkpoint then saves placeholders, not reused bytes.
        operation.param_info.release_memory()
        return operation

    def release_swap_buffers(self, parameter):
        # DeepSpeed frees only the buffers of the sub-group that is stepping, not of one being read.
        stepping = self.swap_ops[SYNC_SWAP_IN]
        releases = stepping is not None and stepping.is_parameter(parameter)
        super().release_swap_buffers(parameter)
        if releases:
            self._drop_packed_state(parameter)

    def writeback_optimizer_state_and_gradients(self, parameter, write_opt_state, write_gradients):
        super().writeback_optimizer_state_and_gradients(parameter, write_opt_state, write_gradients)
        self._drop_packed_state(parameter)

    def _drop_packed_state(self, parameter) -> None:
        """The state's buffer went back to the pool with its operation's: the views must not outlive it."""
        if self._packed_buffers.pop(self._id(parameter), None) is not None:
            self._leave_placeholders(parameter)
