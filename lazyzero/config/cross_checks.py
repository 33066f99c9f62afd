"""Checks of the "lazyzero" section against the DeepSpeed settings around it, and of those settings
that lazyzero relies on. Read-only: they look at the file system but never create anything
(docs/reliability.md, guarantee 6 and row 11).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lazyzero.checkpoint.config import checkpoint_problems
from lazyzero.config.async_io import async_io_problems
from lazyzero.config.errors import Problem
from lazyzero.config.models import LazyZeroConfig
from lazyzero.config.plan_checks import plan_problems
from lazyzero.gradients.config import gradients_problems
from lazyzero.optimizer.config import optimizer_problems

WRITABLE_DIRECTORY = "an existing directory this process can write to"
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
        problems += _nvme_folder_problems("lazyzero.plan.nvme_path", config.plan.nvme_path)
    problems += optimizer_problems(config.optimizer, ds_config)
    problems += gradients_problems(config.gradients, ds_config, world_size)
    problems += _activation_conflicts(config, ds_config)
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
    return _nvme_folder_problems(f"{path}.nvme_path", offload["nvme_path"])


def _nvme_folder_problems(path: str, directory: Any) -> list[Problem]:
    """A folder the run swaps to: writable (`_directory_problems`), on a machine where DeepSpeed's
    async_io loads (`lazyzero/config/async_io.py`)."""
    return _directory_problems(path, directory) or async_io_problems(path)


def _directory_problems(path: str, directory: Any) -> list[Problem]:
    """Empty if `directory` exists, is a directory and is writable; checked without creating anything."""
    if not isinstance(directory, str) or not directory:
        return [Problem.bad_value(path, directory, WRITABLE_DIRECTORY)]
    if not os.path.exists(directory):
        reason = "it does not exist; lazyzero does not create it"
    elif not os.path.isdir(directory):
        reason = "it is not a directory"
    elif not os.access(directory, os.W_OK | os.X_OK):
        reason = "this process may not write to it"
    else:
        return []
    return [Problem.bad_value(path, directory, f"{WRITABLE_DIRECTORY} ({reason})")]


def _activation_conflicts(config: LazyZeroConfig, ds_config: dict) -> list[Problem]:
    problems = _activation_offload_problems(config.activations)
    checkpointing = ds_config.get("activation_checkpointing")
    if not config.activations.enabled or not isinstance(checkpointing, dict):
        return problems
    if checkpointing.get("cpu_checkpointing") is not True:
        return problems
    return problems + [Problem.conflict(
        "activation_checkpointing.cpu_checkpointing", True, "false while lazyzero.activations.enabled is true",
        "lazyzero's hooks already decide where saved activations live, and DeepSpeed's CPU "
        "checkpointing breaks backward on the CPU accelerator")]


# lazyzero.ops.quant_reference.MAX_OUTLIER_BLOCK (an outlier's index in its block is one byte); repeated here
# because validating a config imports neither torch nor deepspeed (tests/config/test_config.py checks both).
MAX_OUTLIER_BLOCK = 256


def _activation_offload_problems(activations) -> list[Problem]:
    """`offload_layers` against the rest of the section, and its NVMe folder (docs/reliability.md, what is tested)."""
    path = "lazyzero.activations"
    offload = activations.offload_layers
    problems = []
    if offload and not activations.enabled:
        problems.append(Problem.bad_value(
            f"{path}.offload_layers", offload,
            f"{{}} while {path}.enabled is false (the offload moves what the activation hooks store)"))
    recomputed = sorted(set(offload) & set(activations.recompute_layers))
    if recomputed:
        problems.append(Problem.bad_value(
            f"{path}.offload_layers", offload,
            f"layers that are not in {path}.recompute_layers (a recomputed layer keeps only its input, for the "
            f"recompute); layers {recomputed} are in both"))
    if "nvme" in offload.values() and activations.offload_nvme_path is None:
        problems.append(Problem.missing(f"{path}.offload_nvme_path",
                                        f"{WRITABLE_DIRECTORY} when a layer of {path}.offload_layers is 'nvme'"))
    if activations.offload_nvme_path is not None:
        problems += (_nvme_folder_problems if "nvme" in offload.values() else _directory_problems)(
            f"{path}.offload_nvme_path", activations.offload_nvme_path)
    if activations.keep_outliers and activations.block_size > MAX_OUTLIER_BLOCK:
        problems.append(Problem.bad_value(
            f"{path}.block_size", activations.block_size,
            f"at most {MAX_OUTLIER_BLOCK} while {path}.keep_outliers is true (an outlier's index in its block is one "
            "byte); or set keep_outliers to false"))
    return problems
