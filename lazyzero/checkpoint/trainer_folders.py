"""Lazy checkpoints under the Hugging Face Trainer's folder rules (docs/checkpoint.md, "Under the Trainer").

The Trainer saves each checkpoint into its own `checkpoint-N/` folder (DeepSpeed's tag folder and
`latest` inside it, beside the Trainer's own files), deletes old folders beyond `save_total_limit`
right after the save returns, and resumes from the folder with the highest N. With lazy checkpoints
the save returns while the files are still being written, so two of its rules would lose work:
- rotation would delete the newest committed folder while the new one is still uncommitted, leaving
  no loadable checkpoint until the commit (none at all if the run dies first);
- after a run killed during a background write, the highest N holds the Trainer's files but no
  committed DeepSpeed tag, and resuming from it fails.

`lazyzero.patch_deepspeed()` routes the two functions the Trainer calls for these rules
(`transformers.trainer.rotate_checkpoints` and `get_last_checkpoint`, through the patch point) to the
versions below: a folder whose lazy checkpoint is uncommitted does not count toward
`save_total_limit` while it is newer than every committed one, and is never chosen to resume from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lazyzero.checkpoint.folder_layout import TEMP_PREFIX
from lazyzero.checkpoint.manifest import committed_tags

OWNER = "lazyzero.patch_deepspeed"
TRAINER_MODULE = "transformers.trainer"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")  # the Trainer's folder names (PREFIX_CHECKPOINT_DIR)


def holds_uncommitted_checkpoint(folder: str | os.PathLike) -> bool:
    """A Trainer checkpoint folder whose lazy checkpoint is still being written, or was cut short:
    a temporary tag folder and no committed tag."""
    root = Path(folder)
    if not root.is_dir():
        return False
    writing = any(path.is_dir() and path.name.startswith(TEMP_PREFIX) for path in root.iterdir())
    return writing and not committed_tags(root)


def _original(name: str):
    import sys

    return getattr(sys.modules[TRAINER_MODULE], name).__wrapped__


def get_last_committed_checkpoint(folder):
    """`get_last_checkpoint(folder)`, skipping folders whose lazy checkpoint is uncommitted."""
    steps, skipped = {}, False
    for name in os.listdir(folder):
        match = CHECKPOINT_NAME.fullmatch(name)
        if not match or not (Path(folder) / name).is_dir():
            continue
        if holds_uncommitted_checkpoint(Path(folder) / name):
            skipped = True
        else:
            steps[name] = int(match.group(1))
    if not skipped:
        return _original("get_last_checkpoint")(folder)
    return os.path.join(folder, max(steps, key=steps.get)) if steps else None


def rotate_keeping_committed(output_dir, save_total_limit=None, best_model_checkpoint=None, use_mtime=False,
                             checkpoint_prefix="checkpoint"):
    """`rotate_checkpoints` with the folders newer than every committed one left out of the count while
    their lazy checkpoints are uncommitted, so that the newest committed folder is never deleted for them."""
    original = _original("rotate_checkpoints")
    if save_total_limit is None or save_total_limit <= 0:
        return original(output_dir, save_total_limit, best_model_checkpoint, use_mtime, checkpoint_prefix)
    from transformers.trainer_utils import sort_checkpoints

    pending = 0
    for checkpoint in reversed(sort_checkpoints(output_dir, checkpoint_prefix, use_mtime)):
        if not holds_uncommitted_checkpoint(checkpoint):
            break
        pending += 1
    return original(output_dir, save_total_limit + pending, best_model_checkpoint, use_mtime, checkpoint_prefix)


def route_trainer_folder_rules() -> bool:
    """Route the Trainer's two folder rules to the versions above (when transformers is installed and
    has them as lazyzero knows them); whether they are routed."""
    import importlib
    import importlib.util

    from lazyzero.patch_point import PatchRefused, route_function

    if importlib.util.find_spec("transformers") is None:
        return False
    trainer = importlib.import_module(TRAINER_MODULE)
    try:
        route_function(trainer, "get_last_checkpoint", get_last_committed_checkpoint, owner=OWNER)
        route_function(trainer, "rotate_checkpoints", rotate_keeping_committed, owner=OWNER)
        from lazyzero.checkpoint.trainer_end import add_to_default_callbacks

        add_to_default_callbacks()
    except (PatchRefused, AttributeError) as err:
        import logging

        logging.getLogger(__name__).warning(f"lazyzero: the Hugging Face Trainer's checkpoint rules are not routed "
                                            f"({err}); keep save_total_limit at 2 or more with lazy checkpoints")
        return False
    return True


def unroute_trainer_folder_rules() -> None:
    import sys

    from lazyzero.patch_point import unroute_function

    trainer = sys.modules.get(TRAINER_MODULE)
    if trainer is not None:
        for name in ("get_last_checkpoint", "rotate_checkpoints"):
            unroute_function(trainer, name, owner=OWNER)
        from lazyzero.checkpoint.trainer_end import remove_from_default_callbacks

        remove_from_default_callbacks()
