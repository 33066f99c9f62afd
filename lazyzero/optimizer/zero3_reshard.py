"""Reload ZeRO-3 optimizer state on a different number of data-parallel ranks (docs/optimizer.md).

DeepSpeed 0.19.8 refuses this without a universal checkpoint (`_load_zero_checkpoint`), and its
universal conversion treats every optimizer state as an fp32 slice of the partition, which 8-bit
codes with one scale per block of a rank's flat are not. The layout is known, though: ZeRO-3 cuts
every parameter into pieces of `ceil(numel / W)` elements, one per rank (the last zero-padded), and a
rank's sub-group flat is its pieces of the sub-group's parameters, in order. DeepSpeed saves that
order as `param_shapes`, one dict per sub-group (zero_to_fp32.py reads the same layout). So each rank
builds its new sub-group flats parameter by parameter: the range of the parameter it now holds is read
from the saved ranks' pieces that overlap it (files memory-mapped, so a rank reads only those bytes),
8-bit moments decoded only over the blocks that cover the range, and the new flat's moments encoded
again with its own blocks. fp32 master weights and fp32 moments come back exactly; 8-bit moments move
by the encoding error of their new blocks, none where block edges coincide. Step counts carry over.

With NVMe optimizer offload a swapped sub-group's master and moments are not in the optimizer file
(empty placeholders there) but in the swap files the checkpoint copied to
`offloaded_tensors/rank<NN>/`, named after the ids DeepSpeed gave the parameters in the saving
process (`<first>_<last>`; they count up per process, so they are matched to the parameters by their
order, see `saved_swap_names`). A sub-group this run swaps is swapped in, overwritten and swapped out
again through the optimizer's own swapper, one at a time.
"""

from __future__ import annotations

import math
import os
import re

import deepspeed.comm as dist
import numpy as np
import torch
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

from lazyzero.optimizer.adam8bit_optimizer import CODE_KEYS, EIGHT_BIT_KEYS, FP32_KEYS, decode_moments, encode_moments
from lazyzero.optimizer.nvme_swap import PACKED_FILE_SUFFIX, PackedLayout
from lazyzero.patch_point import set_state
from lazyzero.safe_load import load_checkpoint_file, pickle_allowed

EIGHT_BIT_MOMENTS = ("m", "sqrt_v")
MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
MASTER_SWAP_FILE = re.compile(r"^(\d+)_(\d+)\.tensor\.swp$")


def refusal(engine) -> str | None:
    """Why this engine's ZeRO-3 state cannot be re-split, or None."""
    if getattr(engine.optimizer, "params_in_nvme_and_cpu", False):
        return "with parameters on NVMe"
    if any(not param.requires_grad for param in engine.module.parameters()):
        return "with frozen parameters (DeepSpeed saves their pieces per rank, outside the optimizer state)"
    return None


def model_states_file(load_dir: str, tag: str) -> str:
    """Saved rank 0's model-states file: under ZeRO-3 every rank's holds the same (parameters are
    empty placeholders there), so a rank the checkpoint has no file for reads this one."""
    return os.path.join(load_dir, str(tag), MODEL_STATES)


class SavedRanks:
    """The saved ranks' ZeRO-3 optimizer state, read range by range."""

    def __init__(self, files: list[str], param_shapes: list[dict], creation_order: dict[str, int],
                 allow_pickle: bool = False):
        self.documents = [load_checkpoint_file(path, "cpu", allow_pickle, mmap=True)[OPTIMIZER_STATE_DICT]
                          for path in files]
        self.world = len(files)
        base = self.documents[0][OPTIMIZER_STATE_DICT]
        self.block_sizes = {index: group.get("block_size")
                            for group in base["param_groups"] for index in group["params"]}
        self.where, self.numels = self._layout(param_shapes)
        swapped = [sub_group for sub_group, numel in enumerate(self.numels)
                   if numel and not self.documents[0][FP32_FLAT_GROUPS][sub_group].numel()]
        folders = [os.path.join(os.path.dirname(path), "offloaded_tensors", f"rank{rank:02d}")
                   for rank, path in enumerate(files)]
        names = saved_swap_names(folders[0], [list(param_shapes[sub_group]) for sub_group in swapped], creation_order)
        self.swap_files = {sub_group: [os.path.join(folder, names[index]) for folder in folders]
                           for index, sub_group in enumerate(swapped)}
        self._sources: dict[tuple[int, int], dict] = {}

    def _layout(self, param_shapes: list[dict]) -> tuple[dict[str, tuple[int, int, int]], list[int]]:
        """name -> (sub-group, offset of the piece in each saved rank's flat, numel); elements per
        rank of each sub-group."""
        where, numels = {}, []
        if len(param_shapes) != len(self.documents[0][FP32_FLAT_GROUPS]):
            raise ValueError(f"the checkpoint lists {len(param_shapes)} parameter sub-groups but saved "
                             f"{len(self.documents[0][FP32_FLAT_GROUPS])} fp32 flats; it cannot be re-split")
        for sub_group, shapes in enumerate(param_shapes):
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                where[name] = (sub_group, offset, numel)
                offset += -(-numel // self.world)
            numels.append(offset)
            held = self.documents[0][FP32_FLAT_GROUPS][sub_group].numel()
            if held not in (0, offset):  # 0: swapped to NVMe, a placeholder
                raise ValueError(f"saved sub-group {sub_group} holds {held} weights per rank, its parameters' pieces "
                                 f"{offset}: not a ZeRO-3 layout this version can re-split")
        return where, numels

    def step_of(self, name: str):
        return self._state(0, self.where[name][0])["step"]

    def read(self, name: str, start: int, end: int, eight_bit: bool) -> dict[str, torch.Tensor]:
        """Elements [start, end) of parameter `name`: fp32 "value" and the moments, as ("m",
        "sqrt_v") when `eight_bit`, else as torch's ("exp_avg", "exp_avg_sq"); all fp32."""
        sub_group, offset, numel = self.where[name]
        piece = -(-numel // self.world)
        parts = []
        for rank in range(start // piece, -(-end // piece)) if end > start else ():
            low, high = max(start, rank * piece) - rank * piece, min(end, (rank + 1) * piece) - rank * piece
            parts.append(self._read_flat(rank, sub_group, offset + low, offset + high, eight_bit))
        keys = ("value", *(EIGHT_BIT_MOMENTS if eight_bit else FP32_KEYS))
        return {key: torch.cat([part[key] for part in parts]) if parts else torch.zeros(0) for key in keys}

    def _state(self, rank: int, sub_group: int) -> dict:
        return self.documents[rank][OPTIMIZER_STATE_DICT]["state"][sub_group]

    def _read_flat(self, rank: int, sub_group: int, low: int, high: int, eight_bit: bool) -> dict[str, torch.Tensor]:
        """Elements [low, high) of one saved rank's sub-group flat and of its moments."""
        source = self._source(rank, sub_group)
        if "m_codes" in self._state(rank, sub_group):
            first, root = _decode_range(source, self.block_sizes[sub_group], self.numels[sub_group], low, high)
            moments = {"m": first, "sqrt_v": root} if eight_bit else {"exp_avg": first, "exp_avg_sq": root * root}
        else:
            first, second = (source[key](low, high) for key in FP32_KEYS)
            moments = {"m": first, "sqrt_v": second.sqrt()} if eight_bit else {"exp_avg": first, "exp_avg_sq": second}
        return {"value": source["value"](low, high), **moments}

    def _source(self, rank: int, sub_group: int) -> dict:
        """Readers of one saved sub-group's tensors, `key -> (start, end) -> tensor`: slices of the
        optimizer file's tensors, or of its swap files when it was swapped to NVMe."""
        if (rank, sub_group) not in self._sources:
            self._sources[rank, sub_group] = self._new_source(rank, sub_group)
        return self._sources[rank, sub_group]

    def _new_source(self, rank: int, sub_group: int) -> dict:
        if sub_group not in self.swap_files:
            state = self._state(rank, sub_group)
            tensors = {"value": self.documents[rank][FP32_FLAT_GROUPS][sub_group],
                       **{key: state[key].view(-1) for key in (*EIGHT_BIT_KEYS, *FP32_KEYS) if key in state}}
            return {key: (lambda start, end, tensor=tensor: tensor[start:end].clone())
                    for key, tensor in tensors.items()}
        return _swap_file_readers(self.swap_files[sub_group][rank], self.numels[sub_group],
                                  self.block_sizes[sub_group], "m_codes" in self._state(rank, sub_group))


def _swap_file_readers(master_path: str, numel: int, block_size: int, eight_bit: bool) -> dict:
    """Readers like `SavedRanks._source`'s over a swapped sub-group's files (fp32 master
    `<id>.tensor.swp`, then `<key>-<id>.tensor.swp` moments or the packed `<id>.adam8bit.swp`)."""
    folder, master = os.path.split(master_path)
    ds_id = master[:-len(".tensor.swp")]
    readers = {"value": _file_reader(master_path, np.float32, 0)}
    if not eight_bit:
        readers.update({key: _file_reader(os.path.join(folder, f"{key}-{ds_id}.tensor.swp"), np.float32, 0)
                        for key in FP32_KEYS})
        return readers
    offsets = PackedLayout.for_partition(numel, block_size, alignment=1).byte_offsets()
    packed = os.path.join(folder, f"{ds_id}{PACKED_FILE_SUFFIX}")
    readers.update({key: _file_reader(packed, np.uint8 if key in CODE_KEYS else np.float32, offsets[key])
                    for key in EIGHT_BIT_KEYS})
    return readers


def _file_reader(path: str, dtype, byte_offset: int):
    """(start, end) -> a tensor of elements [start, end) of `dtype` from `byte_offset` in the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"the checkpoint's NVMe swap file {path} is missing")
    memory = np.memmap(path, dtype=np.uint8, mode="r")

    def read(start: int, end: int) -> torch.Tensor:
        size = np.dtype(dtype).itemsize
        return torch.from_numpy(np.array(memory[byte_offset + start * size:byte_offset + end * size]).view(dtype))
    return read


def saved_swap_names(folder: str, swapped: list[list[str]], creation_order: dict[str, int]) -> dict[int, str]:
    """Index in `swapped` -> the master swap file name of that swapped sub-group (given by its
    parameter names, in order) in a saved rank's `folder`.

    DeepSpeed names it `<id of first parameter>_<id of last>.tensor.swp`, with ids that count up per
    process from wherever that process's earlier models left off. The ids of one model differ from
    their creation order (`creation_order`) by one offset; it is the one under which every swapped
    sub-group's file exists."""
    present = set()
    for name in (os.listdir(folder) if os.path.isdir(folder) else ()):
        match = MASTER_SWAP_FILE.match(name)
        if match:
            present.add((int(match[1]), int(match[2])))
    if not swapped:
        return {}
    ends = [(creation_order[names[0]], creation_order[names[-1]]) for names in swapped]
    for offset in sorted({first - ends[0][0] for first, _ in present}):
        if all((offset + first, offset + last) in present for first, last in ends):
            return {index: f"{offset + first}_{offset + last}.tensor.swp"
                    for index, (first, last) in zip(range(len(swapped)), ends)}
    raise FileNotFoundError(f"{folder} does not hold the NVMe swap files of the checkpoint's swapped sub-groups")


def _decode_range(source: dict, block_size: int, numel: int, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First moment and root of the second over flat elements [low, high), decoding only the blocks
    that cover them."""
    first_block, end_block = low // block_size, -(-high // block_size)
    begin, stop = first_block * block_size, min(end_block * block_size, numel)
    covering = {key: source[key](begin, stop).to(torch.uint8) for key in ("m_codes", "sqrt_v_codes")}
    covering.update({key: source[key](first_block, end_block).float() for key in ("m_scales", "sqrt_v_scales")})
    m, sqrt_v = decode_moments(covering, block_size)
    return m[low - begin:high - begin], sqrt_v[low - begin:high - begin]


def restore_loss_scaler(zero_optimizer, saved: dict, *, owner: str) -> None:
    """Set the ZeRO-3 optimizer's loss scaler, its dynamic flag and the overflow of the last step from
    `saved` (a rank's optimizer state dict), as DeepSpeed's `_rigid_load_state_dict` does, for a resume
    its loader cannot do (a re-split, an NVMe-offloaded optimizer: checkpoint/nvme_restore.py)."""
    set_state(zero_optimizer, "loss_scaler", saved[LOSS_SCALER], owner=owner)
    set_state(zero_optimizer, "dynamic_loss_scale", saved["dynamic_loss_scale"], owner=owner)
    set_state(zero_optimizer, "overflow", saved["overflow"], owner=owner)


def restore(engine, files: list[str], load_dir: str, tag: str) -> None:
    """Fill this rank's fp32 master flats, moments and step counts from `files` (the saved ranks'
    optimizer files, in rank order), then DeepSpeed's bit16 partitions from the master weights."""
    zero = engine.optimizer
    allow_pickle = pickle_allowed(engine.lazyzero_config)
    model_states = load_checkpoint_file(model_states_file(load_dir, tag), "cpu", allow_pickle, mmap=True)
    params = [param for group in zero.fp16_groups for param in group]
    first_id = min(param.ds_id for param in params)
    saved = SavedRanks(files, model_states["param_shapes"],
                       {engine.param_names[param]: param.ds_id - first_id for param in params}, allow_pickle)
    rank = dist.get_rank(group=zero.dp_process_group)
    first = saved.documents[0]
    restore_group_settings(engine.basic_optimizer, first[OPTIMIZER_STATE_DICT]["param_groups"])
    restore_loss_scaler(zero, first, owner="lazyzero.optimizer (re-split resume)")
    if zero.swap_optimizer:
        zero.optimizer_swapper.purge_state()  # the states set below are new tensors
    for sub_group, group_params in enumerate(zero.fp16_groups):
        _restore_sub_group(engine, saved, sub_group, group_params, rank)
    if zero.persistent_parameters:
        zero.persistent_parameters[0].partition(zero.persistent_parameters)


def restore_group_settings(optimizer, saved_groups: list[dict]) -> None:
    """Each saved param group's settings (lr, betas, eps, ...: all but its parameters) into the
    optimizer's group of the same position, as torch's `load_state_dict` does. DeepSpeed's lr
    scheduler restores only its position and sets the lr at its next step, after the optimizer's:
    without this the first step after a re-split ran at the optimizer's initial lr (0 under a warm-up)."""
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(saved_groups)} optimizer param groups, this optimizer "
                         f"{len(optimizer.param_groups)}; cannot re-split it")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update({key: value for key, value in saved.items() if key != "params"})


def _restore_sub_group(engine, saved: SavedRanks, sub_group: int, params: list, rank: int) -> None:
    """One sub-group's master, moments and bit16 partition; a swapped one is swapped in first and
    out after, so that at most one is in host memory."""
    zero, basic = engine.optimizer, engine.basic_optimizer
    swapped = zero._swappable_optimizer_subgroup(sub_group)
    if swapped:
        zero._optimizer_states_and_gradient_swap_in(sub_group)
    current = zero.fp32_partitioned_groups_flat[sub_group]
    group = basic.param_groups[zero.sub_group_to_group_id[sub_group]]
    eight_bit = basic.uses_8bit_state(current, group)
    columns = _sub_group_columns(engine, saved, params, rank, eight_bit)
    if columns["value"].numel() != current.numel():
        raise ValueError(f"sub-group {sub_group}: rebuilt {columns['value'].numel()} elements for a flat of "
                         f"{current.numel()}; cannot re-split this checkpoint")
    current.data.copy_(columns["value"])
    state = {"step": saved.step_of(engine.param_names[params[0]])}
    if eight_bit:
        state.update(encode_moments(columns["m"], columns["sqrt_v"], group["block_size"]))
    else:
        state.update({key: columns[key] for key in FP32_KEYS})
    basic.state[current] = {key: value.to(current.device) if torch.is_tensor(value) else value
                            for key, value in state.items()}
    zero._reassign_or_swap_out_partitioned_parameters(sub_group)
    if swapped:
        zero._optimizer_states_and_gradient_swap_out(sub_group)


def _sub_group_columns(engine, saved: SavedRanks, params: list, rank: int, eight_bit: bool) -> dict[str, torch.Tensor]:
    """This rank's pieces of `params`, each zero-padded to its partition size, concatenated."""
    pieces = []
    for param in params:
        size = param.partition_numel()
        start = min(rank * size, param.ds_numel)
        read = saved.read(engine.param_names[param], start, min(start + size, param.ds_numel), eight_bit)
        pieces.append({key: torch.nn.functional.pad(value, (0, size - value.numel())) for key, value in read.items()})
    return {key: torch.cat([piece[key] for piece in pieces]) for key in pieces[0]}
