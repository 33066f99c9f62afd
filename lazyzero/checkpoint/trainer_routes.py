"""`lazyzero.patch_deepspeed()`'s changes to the trainers for lazy checkpoints, through the patch
point, where each library is installed (docs/checkpoint.md, "Under the trainers" and "The end of a
job"): the folder rules of trainer_folders.py, lightning_folders.py and accelerate_folders.py, and
the Hugging Face Trainer's end-of-training callback (trainer_end.py). Each library is imported only
when it is installed (an optional dependency), which is why its imports sit inside the functions.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

from lazyzero.checkpoint.accelerate_folders import load_newest_committed_state
from lazyzero.checkpoint.lightning_folders import find_last_committed_checkpoints
from lazyzero.checkpoint.trainer_folders import OWNER, get_last_committed_checkpoint, rotate_keeping_committed

_log = logging.getLogger(__name__)


def route_trainer_folder_rules() -> list[str]:
    """Route the folder rules of each installed trainer library to the versions above; the libraries
    whose rules are routed. A library whose functions are not as lazyzero knows them is left as it is,
    with a warning."""
    routed = []
    for library, route, hint in ((("transformers", _route_hf_trainer, "keep save_total_limit at 2 or more"),
                                  ("lightning", _route_lightning, "pass ckpt_path a committed folder"),
                                  ("accelerate", _route_accelerate, "pass load_state a committed folder"))):
        if importlib.util.find_spec(library) is None:
            continue
        try:
            route()
        except Exception as err:  # noqa: BLE001 - PatchRefused, or a library without the function
            _log.warning(f"lazyzero: {library}'s checkpoint-folder rules are not routed ({err}); with lazy "
                         f"checkpoints, {hint}")
            continue
        routed.append(library)
    return routed


def _route_hf_trainer() -> None:
    from transformers import trainer, trainer_utils

    from lazyzero.patch_point import redirect_function, route_function

    redirect_function(trainer_utils, "get_last_checkpoint", get_last_committed_checkpoint, owner=OWNER)
    route_function(trainer, "rotate_checkpoints", rotate_keeping_committed, owner=OWNER)
    from lazyzero.checkpoint.trainer_end import add_to_default_callbacks

    add_to_default_callbacks()


def _route_lightning() -> None:
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

    from lazyzero.patch_point import route_function

    route_function(ModelCheckpoint, "_find_last_checkpoints", find_last_committed_checkpoints, owner=OWNER)


def _route_accelerate() -> None:
    from accelerate import Accelerator

    from lazyzero.patch_point import route_function

    route_function(Accelerator, "load_state", load_newest_committed_state, owner=OWNER)


def unroute_trainer_folder_rules() -> None:
    from lazyzero.patch_point import unredirect_function, unroute_function

    if "transformers.trainer_utils" in sys.modules:
        unredirect_function(sys.modules["transformers.trainer_utils"], "get_last_checkpoint", owner=OWNER)
    if "transformers.trainer" in sys.modules:
        unroute_function(sys.modules["transformers.trainer"], "rotate_checkpoints", owner=OWNER)
        from lazyzero.checkpoint.trainer_end import remove_from_default_callbacks

        remove_from_default_callbacks()
    if "lightning.pytorch.callbacks.model_checkpoint" in sys.modules:
        model_checkpoint = sys.modules["lightning.pytorch.callbacks.model_checkpoint"]
        unroute_function(model_checkpoint.ModelCheckpoint, "_find_last_checkpoints", owner=OWNER)
    if "accelerate.accelerator" in sys.modules:
        unroute_function(sys.modules["accelerate.accelerator"].Accelerator, "load_state", owner=OWNER)
