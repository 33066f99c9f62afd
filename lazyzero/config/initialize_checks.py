"""DeepSpeed settings with which `deepspeed.initialize` builds something `lazyzero.initialize` does not.

Every config-dependent step of DeepSpeed's initialize is either taken by lazyzero's too or refused
here, before torch.distributed starts (docs/deepspeed-internals.md, "`deepspeed.initialize` and
`lazyzero.initialize`", lists each one). Pipeline models are refused by `lazyzero.initialize` itself:
DeepSpeed picks its pipeline engine from the model's class, not from the config.
"""

from __future__ import annotations

from typing import Optional

from lazyzero.config.errors import Problem
from lazyzero.config.models import LazyZeroConfig


def initialize_problems(config: Optional[LazyZeroConfig], ds_config: dict) -> list[Problem]:
    """Settings that would make DeepSpeed build another engine, or shard layers lazyzero's capabilities
    do not handle. `config`: the valid "lazyzero" section, or None when it has problems of its own."""
    return _hybrid_engine_problems(ds_config) + _autotp_problems(config, ds_config)


def _hybrid_engine_problems(ds_config: dict) -> list[Problem]:
    # deepspeed.initialize builds DeepSpeedHybridEngine for it, an engine class LazyZeroEngine is not.
    section = ds_config.get("hybrid_engine")
    if not isinstance(section, dict) or not section.get("enabled"):
        return []
    return [Problem.bad_value(
        "hybrid_engine.enabled", section["enabled"],
        "false (DeepSpeed's hybrid engine for RLHF generation is another engine class than LazyZeroEngine; "
        "train it with deepspeed.initialize and a config without a \"lazyzero\" section)")]


def _autotp_problems(config: Optional[LazyZeroConfig], ds_config: dict) -> list[Problem]:
    # AutoTP replaces the model's linear layers by tensor-parallel shards and reduces their gradients in
    # groups of its own; no capability is built or tested for that. With every capability off the
    # engine is DeepSpeed's, and lazyzero.initialize switches AutoTP on as deepspeed.initialize does.
    tensor_parallel = ds_config.get("tensor_parallel")
    size = tensor_parallel.get("autotp_size", 0) if isinstance(tensor_parallel, dict) else 0
    if config is None or not config.enabled_features() or type(size) is not int or size <= 1:
        return []
    enabled = ", ".join(f"lazyzero.{name}" for name in config.enabled_features())
    return [Problem.bad_value(
        "tensor_parallel.autotp_size", size,
        f"0 or 1 while a lazyzero capability is on (on: {enabled}; none handles AutoTP's tensor-parallel "
        "shards: switch them off to train with AutoTP as plain DeepSpeed)")]
