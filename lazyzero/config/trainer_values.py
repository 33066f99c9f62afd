"""Values a trainer fills in: "auto" in a DeepSpeed config handed to the Hugging Face Trainer or Accelerate.

Those trainers replace each "auto" by a value of their own arguments (batch sizes, learning rate,
precision, bucket sizes) before they call `deepspeed.initialize`, so the engine never sees one. A
file checked on its own (`lazyzero config check`) still holds them: such keys cannot be checked,
and DeepSpeed's own parse, which fails on them, reads the file without them (docs/config.md,
"Configs for the Hugging Face Trainer and Accelerate"). Inside the "lazyzero" section no trainer
fills anything in, so "auto" there stays an error.
"""

from __future__ import annotations

import copy

AUTO = "auto"
# DeepSpeed refuses a config with none of these (deepspeed/runtime/config.py, batch assertion).
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# What DeepSpeed's parse reads in place of batch sizes a trainer fills in: any valid one will do,
# the real ones are checked at `deepspeed.initialize`.
STAND_IN_MICRO_BATCH = 1


def trainer_filled_keys(ds_config: dict) -> list[str]:
    """Dotted paths of the "auto" values outside the "lazyzero" section, in file order."""
    return [path for path in _auto_paths(ds_config, "") if path.split(".")[0] != "lazyzero"]


def without_trainer_filled(ds_config: dict) -> dict:
    """A copy of `ds_config` without its trainer-filled keys, which DeepSpeed's parse can read:
    with a stand-in micro-batch size when every batch size was "auto"."""
    view = copy.deepcopy(ds_config)
    keys = trainer_filled_keys(ds_config)
    for path in keys:
        *parents, name = path.split(".")
        holder = view
        for parent in parents:
            holder = holder[parent]
        del holder[name]
    if keys and not any(key in view for key in BATCH_KEYS[:2]):
        view["train_micro_batch_size_per_gpu"] = STAND_IN_MICRO_BATCH
    return view


def _auto_paths(value: object, prefix: str) -> list[str]:
    if not isinstance(value, dict):
        return []
    paths = []
    for key, item in value.items():
        path = f"{prefix}{key}"
        if item == AUTO:
            paths.append(path)
        else:
            paths += _auto_paths(item, f"{path}.")
    return paths
