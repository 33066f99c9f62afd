"""Reload ZeRO-3 optimizer state on a different number of data-parallel ranks (issue 5).

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
"""

from __future__ import annotations

import math
import os

import deepspeed.comm as dist
import torch
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, LOSS_SCALER, OPTIMIZER_STATE_DICT

from lazyzero.optim.adam8bit import FP32_KEYS, decode_moments, encode_moments

EIGHT_BIT_MOMENTS = ("m", "sqrt_v")
MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def refusal(engine) -> str | None:
    """Why this engine's ZeRO-3 state cannot be re-split, or None."""
    zero = engine.optimizer
    if getattr(zero, "swap_optimizer", False) or getattr(zero, "params_in_nvme_and_cpu", False):
        return "with parameters or optimizer states on NVMe"
    if any(not param.requires_grad for param in engine.module.parameters()):
        return "with frozen parameters (DeepSpeed saves their pieces per rank, outside the optimizer state)"
    return None


def model_states_file(load_dir: str, tag: str) -> str:
    """Saved rank 0's model-states file: under ZeRO-3 every rank's holds the same (parameters are
    empty placeholders there), so a rank the checkpoint has no file for reads this one."""
    return os.path.join(load_dir, str(tag), MODEL_STATES)


class SavedRanks:
    """The saved ranks' ZeRO-3 optimizer files, read range by range."""

    def __init__(self, files: list[str], param_shapes: list[dict]):
        self.documents = [torch.load(path, map_location="cpu", mmap=True, weights_only=False)[OPTIMIZER_STATE_DICT]
                          for path in files]
        self.world = len(files)
        base = self.documents[0][OPTIMIZER_STATE_DICT]
        self.block_sizes = {index: group.get("block_size") for group in base["param_groups"] for index in group["params"]}
        self.where = self._layout(param_shapes)

    def _layout(self, param_shapes: list[dict]) -> dict[str, tuple[int, int, int]]:
        """name -> (sub-group, offset of the piece in each saved rank's flat, numel)."""
        where = {}
        flats = self.documents[0][FP32_FLAT_GROUPS]
        if len(param_shapes) != len(flats):
            raise ValueError(f"the checkpoint lists {len(param_shapes)} parameter sub-groups but saved {len(flats)} "
                             "fp32 flats; it cannot be re-split for another number of ranks")
        for sub_group, shapes in enumerate(param_shapes):
            offset = 0
            for name, shape in shapes.items():
                numel = math.prod(shape)
                where[name] = (sub_group, offset, numel)
                offset += -(-numel // self.world)
            state = self._state(0, sub_group)
            moments = state["m_codes"] if "m_codes" in state else state[FP32_KEYS[0]]
            if not offset == flats[sub_group].numel() == moments.numel():
                raise ValueError(f"saved sub-group {sub_group} holds {flats[sub_group].numel()} weights and "
                                 f"{moments.numel()} moments per rank, its parameters' pieces {offset}: not a ZeRO-3 "
                                 "layout this version can re-split")
        return where

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
        state = self._state(rank, sub_group)
        value = self.documents[rank][FP32_FLAT_GROUPS][sub_group][low:high].float()
        if "m_codes" in state:
            first, root = _decode_range(state, self.block_sizes[sub_group], low, high)
            moments = {"m": first, "sqrt_v": root} if eight_bit else {"exp_avg": first, "exp_avg_sq": root * root}
        else:
            first, second = (state[key].view(-1)[low:high].float() for key in FP32_KEYS)
            moments = {"m": first, "sqrt_v": second.sqrt()} if eight_bit else {"exp_avg": first, "exp_avg_sq": second}
        return {"value": value, **moments}


def _decode_range(state: dict, block_size: int, low: int, high: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First moment and root of the second over flat elements [low, high), decoding only the blocks
    that cover them."""
    first_block, end_block = low // block_size, -(-high // block_size)
    begin, stop = first_block * block_size, min(end_block * block_size, state["m_codes"].numel())
    covering = {"m_codes": state["m_codes"][begin:stop].to(torch.uint8),
                "sqrt_v_codes": state["sqrt_v_codes"][begin:stop].to(torch.uint8),
                "m_scales": state["m_scales"][first_block:end_block].float(),
                "sqrt_v_scales": state["sqrt_v_scales"][first_block:end_block].float()}
    m, sqrt_v = decode_moments(covering, block_size)
    return m[low - begin:high - begin], sqrt_v[low - begin:high - begin]


def restore(engine, files: list[str], load_dir: str, tag: str) -> None:
    """Fill this rank's fp32 master flats, moments and step counts from `files` (the saved ranks'
    optimizer files, in rank order), then DeepSpeed's bit16 partitions from the master weights."""
    zero, basic = engine.optimizer, engine.basic_optimizer
    model_states = torch.load(model_states_file(load_dir, tag), map_location="cpu", mmap=True, weights_only=False)
    saved = SavedRanks(files, model_states["param_shapes"])
    rank = dist.get_rank(group=zero.dp_process_group)
    flats = []
    for sub_group, params in enumerate(zero.fp16_groups):
        current = zero.fp32_partitioned_groups_flat[sub_group]
        group = basic.param_groups[zero.sub_group_to_group_id[sub_group]]
        eight_bit = basic.uses_8bit_state(current, group)
        columns = _sub_group_columns(engine, saved, params, rank, eight_bit)
        if columns["value"].numel() != current.numel():
            raise ValueError(f"sub-group {sub_group}: rebuilt {columns['value'].numel()} elements for a flat of "
                             f"{current.numel()}; cannot re-split this checkpoint")
        state = {"step": saved.step_of(engine.param_names[params[0]])}
        if eight_bit:
            state.update(encode_moments(columns["m"], columns["sqrt_v"], group["block_size"]))
        else:
            state.update({key: columns[key] for key in FP32_KEYS})
        basic.state[current] = {key: value.to(current.device) if torch.is_tensor(value) else value
                                for key, value in state.items()}
        flats.append(columns["value"])
    first = saved.documents[0]
    # DeepSpeed's own rigid load, given the rebuilt flats, copies them into the fp32 masters and the
    # bit16 partitions and re-points the parameters' pieces at them.
    zero._rigid_load_state_dict({LOSS_SCALER: first[LOSS_SCALER], "dynamic_loss_scale": first["dynamic_loss_scale"],
                                 "overflow": first["overflow"], FP32_FLAT_GROUPS: flats}, load_optimizer_states=False)
    if zero.persistent_parameters:
        zero.persistent_parameters[0].partition(zero.persistent_parameters)


def _sub_group_columns(engine, saved: SavedRanks, params: list, rank: int, eight_bit: bool) -> dict[str, torch.Tensor]:
    """This rank's pieces of `params`, each zero-padded to its partition size, concatenated."""
    pieces = []
    for param in params:
        size = param.partition_numel()
        start = min(rank * size, param.ds_numel)
        read = saved.read(engine.param_names[param], start, min(start + size, param.ds_numel), eight_bit)
        pieces.append({key: torch.nn.functional.pad(value, (0, size - value.numel())) for key, value in read.items()})
    return {key: torch.cat([piece[key] for piece in pieces]) for key in pieces[0]}
