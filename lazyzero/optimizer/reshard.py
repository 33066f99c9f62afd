"""Reload 8-bit optimizer states on a different number of data-parallel ranks (ZeRO 1 and 2 here,
ZeRO-3 in zero3_reshard.py).

DeepSpeed re-splits optimizer states for another rank count only through its elastic or universal
checkpoints, which treat every state as an fp32 slice of the partition. The 8-bit states are codes
plus one scale per block of *this rank's* partition, so they are re-split here instead: every saved
rank's moments are decoded to fp32, joined in rank order into the group's whole flat moment (ZeRO 1/2
partitions are consecutive slices of one flat group), cut at the new partition boundaries and
encoded again with the new blocks. The moments change by the encoding error of their new blocks
(same codes, so no change at all, where block boundaries coincide); step counts carry over. The fp32
master weights come from the model weights DeepSpeed loads (`_restore_from_bit16_weights`), exact
for fp32 models.
"""

from __future__ import annotations

import glob
import os

import deepspeed.comm as dist
import torch
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT

from lazyzero.optimizer import zero3_reshard
from lazyzero.optimizer.adam8bit_optimizer import decode_moments, encode_moments
from lazyzero.safe_load import load_checkpoint_file, pickle_allowed


def saved_optimizer_files(load_dir: str, tag: str) -> list[str]:
    """The tag's ZeRO optimizer files, in data-parallel rank order (model-parallel rank 0)."""
    pattern = os.path.join(load_dir, str(tag), "*zero_pp_rank_*_mp_rank_00_optim_states.pt")
    return sorted(glob.glob(pattern),
                  key=lambda path: int(os.path.basename(path).split("zero_pp_rank_")[1].split("_")[0]))


def reshard_needed(engine, load_dir: str, tag: str) -> bool:
    """True when the tag was saved by another number of data-parallel ranks and can be re-split here;
    a ValueError naming both counts and the reason when it cannot."""
    saved = len(saved_optimizer_files(load_dir, tag))
    if saved == 0 or saved == engine.dp_world_size:
        return False
    why_not = zero3_reshard.refusal(engine) if engine.zero_optimization_stage() == 3 else None
    if why_not:
        raise ValueError(
            f"checkpoint {os.path.join(load_dir, str(tag))} was saved by {saved} data-parallel ranks, this run has "
            f"{engine.dp_world_size}: 8-bit optimizer states cannot be re-split {why_not}; load with {saved} "
            "ranks, or with load_optimizer_states=False to restart the optimizer")
    return True


def restore_resharded_states(engine, load_dir: str, tag: str) -> None:
    """Fill this rank's optimizer states from all saved ranks' files (see the module docstring)."""
    if engine.zero_optimization_stage() == 3:
        zero3_reshard.restore(engine, saved_optimizer_files(load_dir, tag), load_dir, tag)
        return
    allow_pickle = pickle_allowed(engine.lazyzero_config)
    saved = [load_checkpoint_file(path, "cpu", allow_pickle)[OPTIMIZER_STATE_DICT][BASE_OPTIMIZER_STATE]
             for path in saved_optimizer_files(load_dir, tag)]
    optimizer = engine.basic_optimizer
    zero3_reshard.restore_group_settings(optimizer, saved[0]["param_groups"])
    rank = dist.get_rank(group=engine.optimizer.dp_process_group)
    for index, group in enumerate(optimizer.param_groups):
        (partition,) = group["params"]
        per_rank = [document["state"][index] for document in saved]
        start, size = rank * partition.numel(), partition.numel()
        state = optimizer.state[partition]
        state.clear()
        state["step"] = per_rank[0]["step"]
        if "m_codes" in per_rank[0]:
            block = group["block_size"]
            m, sqrt_v = (torch.cat(parts) for parts in zip(*(decode_moments(r, block) for r in per_rank)))
            state.update(encode_moments(_padded_slice(m, start, size), _padded_slice(sqrt_v, start, size), block))
        else:
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = _padded_slice(torch.cat([r[key].float().view(-1) for r in per_rank]), start, size)
        for key, value in list(state.items()):
            if torch.is_tensor(value):
                state[key] = value.to(partition.device)


def _padded_slice(flat: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """flat[start:start + size], zero-padded past the end (ZeRO pads the last partition)."""
    out = torch.zeros(size, dtype=torch.float32)
    available = max(0, min(size, flat.numel() - start))
    out[:available] = flat[start:start + available]
    return out
