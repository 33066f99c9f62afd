"""NVMe optimizer offload of the 8-bit Adam states at their real size (ZeRO-3).

DeepSpeed 0.19.8's optimizer swapper (`PartitionedOptimizerSwapper`) treats every state tensor it
finds in `optimizer.state` as fp32 with the parameter's numel: it copies a uint8 code tensor into
an fp32 swap buffer (four bytes per code on disk) and hands it back as fp32. `EightBitStateSwapper`
keeps DeepSpeed's path for the fp32 master partition, its gradients and fp32 moments (groups that
keep `exp_avg` / `exp_avg_sq`), and swaps the four 8-bit tensors of a sub-group itself: packed into
one byte region of one of the swapper's own pinned buffers and one file, `<ds_id>.adam8bit.swp` in
the swap folder, about 2.03 bytes per element instead of 8.

Packed layout (`PackedLayout`): m_codes (n bytes), sqrt_v_codes (n), padding to 4 bytes, m_scales
(4 * ceil(n/B)), sqrt_v_scales (same), padding to the aio alignment.

Life of a sub-group's 8-bit state: created in host memory by the optimizer's first step; at every
swap-out it is copied (once; later it already lives there) into a pool buffer, written, and the
state entries become empty placeholders, as DeepSpeed does with fp32 moments. At swap-in the file
is read into a pool buffer and the entries become views of it, which the fused step updates in
place. The files are in the swap folder that DeepSpeed's (and the lazy engine's) checkpoints copy,
and `nvme_restore.restore_nvme_offloaded_state` reads them back through the same swap-in.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from deepspeed.runtime.swap_tensor.optimizer_utils import OptimizerSwapper
from deepspeed.runtime.swap_tensor.partitioned_optimizer_swapper import PartitionedOptimizerSwapper
from deepspeed.runtime.swap_tensor.utils import swap_in_tensors, swap_out_tensors

from lazyzero.optimizer.adam8bit_optimizer import CODE_KEYS, EIGHT_BIT_KEYS, SCALE_KEYS

PACKED_FILE_SUFFIX = ".adam8bit.swp"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class PackedLayout:
    """Where each 8-bit state tensor of a partition of `numel` elements lies in its packed bytes."""

    numel: int
    blocks: int
    alignment: int
    """Bytes the total is padded to: aio reads and writes whole aligned blocks."""

    @classmethod
    def for_partition(cls, numel: int, block_size: int, alignment: int) -> PackedLayout:
        return cls(numel=numel, blocks=math.ceil(numel / block_size), alignment=alignment)

    @property
    def scales_offset(self) -> int:
        # fp32 views of a byte buffer need a 4-byte-aligned start.
        return _round_up(2 * self.numel, 4)

    @property
    def total_bytes(self) -> int:
        return _round_up(self.scales_offset + 8 * self.blocks, self.alignment)

    def byte_offsets(self) -> dict[str, int]:
        """Where each of the four state tensors starts in the packed bytes."""
        offsets = {key: index * self.numel for index, key in enumerate(CODE_KEYS)}
        offsets.update({key: self.scales_offset + 4 * index * self.blocks for index, key in enumerate(SCALE_KEYS)})
        return offsets

    def views(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """The four state tensors as views of `packed` (uint8, `total_bytes` long)."""
        offsets = self.byte_offsets()
        views = {key: packed.narrow(0, offsets[key], self.numel) for key in CODE_KEYS}
        views.update({key: packed.narrow(0, offsets[key], 4 * self.blocks).view(torch.float32) for key in SCALE_KEYS})
        return views


class PackedStateSwapping:
    """What both 8-bit swappers share: DeepSpeed's state list without the 8-bit tensors, and the
    packed file, its layout, its pool buffer and the placeholders a swapped-out state leaves."""

    def _get_state_tensors(self, parameter):
        packed = {id(tensor) for tensor in self._eight_bit_state(parameter).values()}
        return [tensor for tensor in super()._get_state_tensors(parameter) if id(tensor) not in packed]

    def packed_path(self, parameter) -> str:
        return os.path.join(self.swap_folder, f"{self._id(parameter)}{PACKED_FILE_SUFFIX}")

    def _check_packed_file(self, parameter) -> str:
        path = self.packed_path(parameter)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"8-bit optimizer state of partition {self._id(parameter)} is swapped out, but "
                                    f"its file {path} is missing")
        return path

    def _submit_packed_read(self, aio_handle, parameter) -> torch.Tensor:
        """Start reading the state's file into a new pool buffer, point the state at the bytes it
        receives (read only after the handle is waited for) and return the buffer."""
        path = self._check_packed_file(parameter)
        layout = self._layout(self._get_param_swap_info(parameter).numel())
        buffer = self._allocate_packed_buffer(layout)
        packed = self._packed_bytes(buffer, layout)
        swap_in_tensors(aio_handle, [packed], [path])
        self.optimizer.state[parameter].update(layout.views(packed))
        return buffer

    def _packed_state_in(self, parameter, buffer: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool buffer, its packed bytes) holding the state of `parameter`: `buffer` where the state
        already lives there, else a new pool buffer it is copied into (its first swap-out)."""
        layout = self._layout(self._get_param_swap_info(parameter).numel())
        state = self.optimizer.state[parameter]
        if buffer is None:
            buffer = self._allocate_packed_buffer(layout)
        packed = self._packed_bytes(buffer, layout)
        for key, view in layout.views(packed).items():
            if state[key].data_ptr() != view.data_ptr():
                if state[key].shape != view.shape:
                    raise RuntimeError(f"8-bit state {key} of partition {self._id(parameter)} has shape "
                                       f"{tuple(state[key].shape)}, expected {tuple(view.shape)}")
                view.copy_(state[key])
                state[key] = view
        return buffer, packed

    def _leave_placeholders(self, parameter) -> None:
        # As DeepSpeed leaves for swapped fp32 moments: checkpoints save them empty.
        state = self.optimizer.state[parameter]
        for key in EIGHT_BIT_KEYS:
            state[key] = torch.empty(0, dtype=state[key].dtype)

    def _eight_bit_state(self, parameter) -> dict[str, torch.Tensor]:
        state = self.optimizer.state.get(parameter, {})
        return {key: state[key] for key in EIGHT_BIT_KEYS if key in state}

    def _manages_packed_state(self, parameter) -> bool:
        return self._id(parameter) in self.swap_params_info and bool(self._eight_bit_state(parameter))

    def _layout(self, numel: int) -> PackedLayout:
        # build_8bit_optimizer gives every group the optimizer's block size.
        return PackedLayout.for_partition(int(numel), self.optimizer.defaults["block_size"], self.aligned_bytes)

    def _allocate_packed_buffer(self, layout: PackedLayout) -> torch.Tensor:
        elements = layout.total_bytes // self.swap_element_size
        buffers = self.swap_buffer_manager.allocate(num_elems=elements, count=1, dtype=self.dtype)
        if buffers is None:
            raise RuntimeError("no free optimizer swap buffer for a packed 8-bit state: raise "
                               "zero_optimization.offload_optimizer.buffer_count")
        return buffers[0]

    @staticmethod
    def _packed_bytes(buffer: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
        return buffer.view(torch.uint8).narrow(0, 0, layout.total_bytes)

    @staticmethod
    def _id(parameter) -> str:
        return OptimizerSwapper.parameter_id(parameter)


class EightBitStateSwapper(PackedStateSwapping, PartitionedOptimizerSwapper):
    """DeepSpeed's partitioned optimizer swapper, with 8-bit states swapped packed at their size:
    every read and write waited for where DeepSpeed's waits."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # ds_id of the fp32 partition -> the pool buffer (fp32 elements) its packed state lives in
        # between swap-in and swap-out.
        self._resident_packed: dict[str, torch.Tensor] = {}

    def swap_in_optimizer_state(self, parameter, async_parameter=None):
        super().swap_in_optimizer_state(parameter, async_parameter)
        if self._manages_packed_state(parameter) and self._id(parameter) not in self._resident_packed:
            self._read_packed_state(parameter)

    def _swap_out_optimizer_state(self, swap_info):
        parameter = swap_info.tensors[0].compute_tensor
        if self._manages_packed_state(parameter):
            buffer, packed = self._packed_state_in(parameter, self._resident_packed.get(self._id(parameter)))
            self._resident_packed[self._id(parameter)] = buffer
            swap_out_tensors(self.aio_handle, [packed], [self.packed_path(parameter)])
            assert self.aio_handle.wait() == 1, f"writing {self.packed_path(parameter)} failed"
        super()._swap_out_optimizer_state(swap_info)

    def release_swap_buffers(self, parameter):
        super().release_swap_buffers(parameter)
        buffer = self._resident_packed.pop(self._id(parameter), None)
        if buffer is not None:
            self._leave_placeholders(parameter)
            self.swap_buffer_manager.free([buffer])

    def _read_packed_state(self, parameter) -> None:
        buffer = self._submit_packed_read(self.aio_handle, parameter)
        assert self.aio_handle.wait() == 1, f"reading {self.packed_path(parameter)} failed"
        self._resident_packed[self._id(parameter)] = buffer
