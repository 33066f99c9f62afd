"""Exact resume of ZeRO-3 runs whose optimizer state is swapped to NVMe (docs/checkpoint.md).

DeepSpeed 0.19.8's `load_checkpoint` handles an NVMe-offloaded optimizer by copying the checkpoint's
`offloaded_tensors/rank<NN>/` back into the swap folder and nothing else: it never reads
`*_optim_states.pt`. A resumed run therefore starts with

- the sub-groups too small to swap (under the aio block size) at their initial fp32 masters, bf16
  partitions and Adam moments;
- an empty torch-optimizer state: the Adam moments in the copied swap files are never read, because
  the swapper only reads the state tensors it finds in `optimizer.state`, and step counts, learning
  rates and the loss scaler are those of a fresh run.

DeepSpeed's own loader (`_rigid_load_state_dict`) cannot fill the gap either: for swapped sub-groups
the checkpoint holds empty placeholders for the fp32 masters and moments (the swap files hold the
data), so it leaves zero-length moments that CPU Adam then steps on, and it assumes every bf16
partition lives in memory. `restore_nvme_offloaded_state` restores the saved state, then reads each
swapped sub-group back through the optimizer's own swap-in and swap-out so that its moments are
registered with the swapper.

Any resume with DeepSpeed's CPU Adam (CPU or NVMe offload) also needs `replay_cpu_adam_after_load`:
its native code recomputes the running beta powers differently after a resume (see there).
"""

from __future__ import annotations

import torch
from deepspeed import comm as dist
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, OPTIMIZER_STATE_DICT
from deepspeed.ops.adam import DeepSpeedCPUAdam

from lazyzero.checkpoint.sub_group_tiers import check_checkpoint_tiers
from lazyzero.optimizer.zero3_reshard import restore_loss_scaler


def restore_nvme_offloaded_state(engine, load_dir: str, tag: str) -> None:
    """Complete DeepSpeed's load of a ZeRO-3 checkpoint whose optimizer state is on NVMe.

    Call after `DeepSpeedEngine.load_checkpoint` has copied the swap files back (it needs them), on
    every rank, with the same `load_dir` and `tag`.
    """
    zero_optimizer = engine.optimizer
    saved = _own_zero_state_dict(engine, load_dir, tag)
    # Before anything is read back: a checkpoint cut into other sub-groups (another placement or
    # sub_group_size) would put one layer's state into another's.
    check_checkpoint_tiers(zero_optimizer, saved[FP32_FLAT_GROUPS])
    zero_optimizer.checkpoint_event_prologue()
    restore_loss_scaler(zero_optimizer, saved, owner="lazyzero.checkpoint (NVMe-offloaded resume)")
    _load_torch_optimizer_state(zero_optimizer, saved[OPTIMIZER_STATE_DICT])
    # The moments now in `optimizer.state` are new tensors; the swapper must forget the old ones.
    zero_optimizer.optimizer_swapper.purge_state()
    for sub_group_id, saved_fp32 in enumerate(saved[FP32_FLAT_GROUPS]):
        if zero_optimizer._swappable_optimizer_subgroup(sub_group_id):
            _reload_swapped_sub_group(zero_optimizer, sub_group_id)
        else:
            zero_optimizer.fp32_partitioned_groups_flat[sub_group_id].data.copy_(saved_fp32.data)
            zero_optimizer._reassign_or_swap_out_partitioned_parameters(sub_group_id)
    zero_optimizer.checkpoint_event_epilogue()


def _own_zero_state_dict(engine, load_dir: str, tag: str) -> dict:
    """This rank's `*_optim_states.pt` content (DeepSpeed reads only its own file fully)."""
    state_dicts = engine._get_all_zero_checkpoints(load_dir, tag)
    if state_dicts is None:
        raise FileNotFoundError(f"no ZeRO optimizer state files for tag {tag!r} in {load_dir}")
    return state_dicts[dist.get_rank(group=engine.optimizer.dp_process_group)]


def _load_torch_optimizer_state(zero_optimizer, saved_state: dict) -> None:
    """Step counts, hyperparameters and in-memory moments into the wrapped torch optimizer.

    The ZeRO-3 optimizer lists its fp32 partitions in the torch optimizer's param groups only around
    state_dict/load_state_dict, so the saved ids map to them in the same order as when saved.
    """
    zero_optimizer._set_fp32_optimizer_param_groups()
    try:
        zero_optimizer.optimizer.load_state_dict(saved_state)
    finally:
        zero_optimizer._clear_fp32_optimizer_param_groups()


def _reload_swapped_sub_group(zero_optimizer, sub_group_id: int) -> None:
    """Read a swapped sub-group's fp32 master and moments from its swap files, refresh its bf16
    partition from the master, and swap it out again.

    The checkpoint saved each swapped moment as a zero-length placeholder. The swapper only tracks
    state tensors of swappable size, so the placeholder is replaced by an uninitialized tensor of
    the partition's size; swap-in then points it at the file's contents. One sub-group at a time,
    so at most one sub-group's moments are in host memory.
    """
    fp32_partition = zero_optimizer.fp32_partitioned_groups_flat[sub_group_id]
    numel = int(zero_optimizer.fp16_partitioned_groups_flat_numel[sub_group_id])
    state = zero_optimizer.optimizer.state.get(fp32_partition, {})
    for key, value in state.items():
        if torch.is_tensor(value) and value.numel() == 0 and numel > 0:
            state[key] = torch.empty(numel, dtype=value.dtype, device=value.device)
    zero_optimizer._optimizer_states_and_gradient_swap_in(sub_group_id)
    zero_optimizer._reassign_or_swap_out_partitioned_parameters(sub_group_id)
    zero_optimizer._optimizer_states_and_gradient_swap_out(sub_group_id)


def replay_cpu_adam_after_load(engine) -> None:
    """After any load whose (ZeRO) optimizer is DeepSpeed's CPU Adam (CPU or NVMe offload)."""
    cpu_adam = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if isinstance(cpu_adam, DeepSpeedCPUAdam):
        replay_cpu_adam_bias_correction(cpu_adam)


def replay_cpu_adam_bias_correction(cpu_adam: DeepSpeedCPUAdam) -> None:
    """Bring the native CPU Adam's running beta powers to where an uninterrupted run has them.

    The C++ optimizer keeps beta1^t and beta2^t as float products updated once per step, and
    recomputes them with pow() when the step it is given is not the next one, as after a resume.
    pow() and the product differ in the last bit at some steps (beta1=0.9 at t=9, beta2=0.95 at
    t=6), which changes the bias correction and breaks bit-exact resume. Replaying steps 1..t on
    empty tensors rebuilds the same product and touches no data. The param groups share one native
    optimizer; the betas of the first are replayed (DeepSpeed's configs give all groups the same).
    """
    steps = {state["step"] for state in cpu_adam.state.values() if "step" in state}
    if not steps:
        return
    if len(steps) > 1:
        raise RuntimeError(f"CPU Adam parameters disagree on the step count: {sorted(steps)}")
    empty = torch.empty(0, dtype=torch.float32)
    group = cpu_adam.param_groups[0]
    beta1, beta2 = group["betas"]
    for step in range(1, int(steps.pop()) + 1):
        cpu_adam.ds_opt_adam.adam_update(cpu_adam.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                         group["weight_decay"], group["bias_correction"], empty, empty, empty,
                                         empty)
