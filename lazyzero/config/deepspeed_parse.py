"""DeepSpeed's own parse of a config (`DeepSpeedConfig`), run without torch.distributed.

`DeepSpeedConfig` can be built before `init_distributed`: it then assumes one rank (world size 1,
checked against DeepSpeed 0.19.8) and ignores the top-level "lazyzero" key. Its batch-size
arithmetic (train_batch_size = micro batch x accumulation steps x world size) would then be
checked for one rank, so for a larger world we hand it one rank's share of train_batch_size,
which makes its checks equivalent to those it runs at `initialize`.
"""

from __future__ import annotations

import copy
from typing import Optional

from lazyzero.config.errors import Problem
from lazyzero.config.trainer_values import without_trainer_filled

_PYDANTIC_LINK_PREFIX = "For further information visit"


def deepspeed_parse_problems(ds_config: dict, world_size: Optional[int], source: Optional[str]) -> list[Problem]:
    """What DeepSpeed's own config parser rejects, as one problem naming the file (or "DeepSpeed config").
    Keys a trainer fills in ("auto") are left out of the parse (trainer_values.py)."""
    ds_config = without_trainer_filled(ds_config)
    if world_size is not None and world_size > 1 and type(ds_config.get("train_batch_size")) is int:
        batch = ds_config["train_batch_size"]
        if batch % world_size:
            return [Problem.bad_value(
                "train_batch_size", batch,
                f"a multiple of the world size {world_size} "
                "(train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size)")]
        view = {**ds_config, "train_batch_size": batch // world_size}
        note = f" (DeepSpeed checked one rank's share: train_batch_size {batch} / world size {world_size})"
    else:
        view, note = ds_config, ""
    # Imported here, not at module level: torch and DeepSpeed take seconds to import, and plain
    # validation (`lazyzero config check` without DeepSpeed checks, `import lazyzero`) must not pay that.
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        # A deep copy: DeepSpeed's parsers may rewrite nested dicts, and the caller's config is not ours to change.
        DeepSpeedConfig(copy.deepcopy(view))
    except Exception as error:  # DeepSpeed reports bad settings as AssertionError, ValueError,
        # pydantic errors, KeyError...
        return [Problem(source or "DeepSpeed config",
                        f"DeepSpeed's own parse failed: {type(error).__name__}: {_one_line(error)}{note}")]
    return []


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith(_PYDANTIC_LINK_PREFIX))
