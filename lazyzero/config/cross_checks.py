"""Checks of the "lazyzero" section against the DeepSpeed settings around it, and of those settings
that lazyzero relies on. Read-only: they look at the file system but never create anything
(docs/reliability.md, guarantee 6 and row 11).
"""

from __future__ import annotations

from typing import Any, Optional

from lazyzero.activations.config import activations_problems
from lazyzero.checkpoint.config import checkpoint_problems
from lazyzero.config.errors import Problem
from lazyzero.config.folders import WRITABLE_DIRECTORY, nvme_folder_problems
from lazyzero.config.models import LazyZeroConfig
from lazyzero.gradients.config import gradients_problems
from lazyzero.optimizer.config import optimizer_problems
from lazyzero.plan.config import plan_problems

ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_SECTIONS = ("offload_param", "offload_optimizer")

def deepspeed_settings_problems(ds_config: dict) -> list[Problem]:
    """ZeRO stage and offload settings that lazyzero builds on."""
    zero = ds_config.get("zero_optimization")
    if zero is None or isinstance(zero, bool):
        # DeepSpeed's legacy form `"zero_optimization": true` means stage 1 with no offload.
        return []
    if not isinstance(zero, dict):
        return [Problem.bad_value("zero_optimization", zero, "an object, or true/false (DeepSpeed's legacy form)")]
    stage = zero.get("stage", 0)
    if type(stage) is not int or stage not in ZERO_STAGES:
        return [Problem.bad_value("zero_optimization.stage", stage, "one of 0, 1, 2, 3")]
    problems = _parameter_offload_conflicts(zero.get("offload_param"), stage)
    for name in OFFLOAD_SECTIONS:
        problems += _offload_problems(f"zero_optimization.{name}", zero.get(name))
    return problems

def lazyzero_against_deepspeed_problems(config: LazyZeroConfig, ds_config: dict,
                                        world_size: Optional[int]) -> list[Problem]:
    """Options of the "lazyzero" section that contradict DeepSpeed's, or this machine."""
    problems = []
    if config.plan.nvme_path is not None:
        problems += nvme_folder_problems("lazyzero.plan.nvme_path", config.plan.nvme_path)
    problems += optimizer_problems(config.optimizer, ds_config)
    problems += gradients_problems(config.gradients, ds_config, world_size)
    problems += activations_problems(config.activations, ds_config)
    problems += checkpoint_problems(config.checkpoint, ds_config)
    problems += plan_problems(config, ds_config)
    return problems

def _parameter_offload_conflicts(offload: Any, stage: int) -> list[Problem]:
    if not isinstance(offload, dict) or offload.get("device", "none") == "none" or stage == 3:
        return []
    return [Problem.conflict(
        "zero_optimization.offload_param.device", offload["device"], "'none' unless zero_optimization.stage is 3",
        f"zero_optimization.stage is {stage}, and DeepSpeed offloads parameters only in stage 3; "
        "it would silently keep them on the device")]

def _offload_problems(path: str, offload: Any) -> list[Problem]:
    if offload is None:
        return []
    if not isinstance(offload, dict):
        return [Problem.bad_value(path, offload, "an object, or null")]
    if offload.get("device", "none") != "nvme":
        return []
    if offload.get("nvme_path") is None:
        return [Problem.missing(f"{path}.nvme_path", f"{WRITABLE_DIRECTORY} when {path}.device is 'nvme'")]
    return nvme_folder_problems(f"{path}.nvme_path", offload["nvme_path"])
