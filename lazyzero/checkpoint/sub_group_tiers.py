"""A restore of an NVMe-offloaded ZeRO-3 checkpoint under the placement it was saved with
(docs/plan.md, "Placement"): the sub-groups a plan's per-layer placement cuts and tiers must be the
ones the checkpoint holds. Kept with the checkpoint code that reads them (nvme_restore.py); the
planner's placement (lazyzero/plan/deepspeed/zero_placement.py) only decides the tiers."""

from __future__ import annotations


def check_checkpoint_tiers(zero_optimizer, saved_fp32_groups: list) -> None:
    """Refuse to restore an NVMe-offloaded ZeRO-3 checkpoint whose sub-groups were cut, ordered or
    tiered otherwise than this run's (another placement or sub_group_size).

    `saved_fp32_groups`: the checkpoint's FP32_FLAT_GROUPS for this rank. Each keeps the `ds_id` of
    its sub-group ("first_last" ZeRO parameter ids); a swapped sub-group's fp32 master lives in its
    swap file and is saved as an empty placeholder, an in-memory one in full. Restoring across a
    change would copy one layer's state into another's, or read swap files that hold a freshly
    initialized state.
    """
    current = zero_optimizer.fp32_partitioned_groups_flat
    if len(saved_fp32_groups) != len(current):
        raise ValueError(f"the checkpoint holds {len(saved_fp32_groups)} ZeRO-3 optimizer sub-groups, this run "
                         f"{len(current)}: {_RESUME_ALIKE}")
    for index, saved in enumerate(saved_fp32_groups):
        where = _sub_group_name(zero_optimizer, index)
        saved_id = getattr(saved, "ds_id", None)
        if saved_id is not None and saved_id != current[index].ds_id:
            raise ValueError(f"the checkpoint's optimizer sub-group {index} holds ZeRO parameters {saved_id}, this "
                             f"run's ({where}) {current[index].ds_id}: {_RESUME_ALIKE}")
        swapped = zero_optimizer._swappable_optimizer_subgroup(index)
        numel = int(zero_optimizer.fp16_partitioned_groups_flat_numel[index])
        if saved.numel() != (0 if swapped else numel):
            was = "swapped to NVMe" if saved.numel() == 0 else f"in memory ({saved.numel()} elements)"
            now = "swaps it to NVMe" if swapped else f"keeps it in memory ({numel} elements)"
            raise ValueError(f"the optimizer state of {where} was saved {was}, but this run {now}: {_RESUME_ALIKE}")


_RESUME_ALIKE = "resume with the placement and sub_group_size the checkpoint was saved with"


def _sub_group_name(zero_optimizer, index: int) -> str:
    first = zero_optimizer.fp16_groups[index][0]
    name = getattr(zero_optimizer, "param_names", {}).get(first, f"ZeRO id {first.ds_id}")
    return f"the sub-group starting at {name}"
