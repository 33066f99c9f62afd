"""Lazy checkpoints under the trainers' folder rules (docs/checkpoint.md, "Under the trainers").

The Hugging Face Trainer saves each checkpoint into its own `checkpoint-N/` folder (DeepSpeed's tag
folder and `latest` inside it, beside the Trainer's own files), deletes old folders beyond `save_total_limit`
right after the save returns, and resumes from the folder with the highest N. With lazy checkpoints
the save returns while the files are still being written, so two of its rules would lose work:
- rotation would delete the newest committed folder while the new one is still uncommitted, leaving
  no loadable checkpoint until the commit (none at all if the run dies first);
- after a run killed during a background write, the highest N holds the Trainer's files but no
  committed DeepSpeed tag, and resuming from it fails.

`lazyzero.patch_deepspeed()` routes, through the patch point, where each library is installed:
- `transformers.trainer_utils.get_last_checkpoint`, on the function itself, so that the Trainer's
  `resume_from_checkpoint=True` and the scripts that bound the name at import (transformers' example
  scripts) get the newest folder whose lazy checkpoint is committed;
- the Trainer's `rotate_checkpoints`: a folder whose lazy checkpoint is uncommitted does not count toward
  `save_total_limit` while it is newer than every committed one;
- Lightning's `ckpt_path="last"` and Accelerate's `load_state()` of the newest folder
  (`lightning_folders.py`, `accelerate_folders.py`).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from lazyzero.checkpoint.folder_layout import TEMP_PREFIX
from lazyzero.checkpoint.manifest import committed_tags, list_checkpoints

OWNER = "lazyzero.patch_deepspeed"
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")  # the Trainer's folder names (PREFIX_CHECKPOINT_DIR)
_log = logging.getLogger(__name__)


def holds_uncommitted_checkpoint(folder: str | os.PathLike) -> bool:
    """A trainer's checkpoint folder whose lazy checkpoint is still being written, or was cut short:
    a temporary tag folder and no committed tag."""
    root = Path(folder)
    if not root.is_dir():
        return False
    writing = any(path.is_dir() and path.name.startswith(TEMP_PREFIX) for path in root.iterdir())
    return writing and not committed_tags(root)


def newest_committed_folder(parent: str | os.PathLike) -> Path | None:
    """The folder directly under `parent` (not a link) whose newest committed lazy checkpoint is the
    newest of all, by the commit time its manifest records; None without any."""
    newest, when = None, None
    for folder in sorted(Path(parent).iterdir()):
        if folder.is_symlink() or not folder.is_dir():
            continue
        committed = [entry for entry in list_checkpoints(folder) if entry.manifest is not None]
        if committed and (when is None or committed[-1].manifest.created_unix > when):
            newest, when = folder, committed[-1].manifest.created_unix
    return newest


def warn_skipped(skipped: list[str], instead: str | os.PathLike | None) -> None:
    """One warning, from the first rank only, that `skipped` folders were passed over for `instead`."""
    if os.environ.get("RANK", "0") != "0":
        return
    chosen = f"the newest committed one is {instead}" if instead else "no folder holds a committed one"
    _log.warning(f"lazyzero: {', '.join(map(str, skipped))}: lazy checkpoint never committed (the run ended "
                 f"while it was written), so it is not resumed from; {chosen}")


def get_last_committed_checkpoint(folder):
    """`get_last_checkpoint(folder)`, skipping folders whose lazy checkpoint is uncommitted."""
    from transformers import trainer_utils

    from lazyzero.patch_point import original_function

    steps, skipped = {}, []
    for name in os.listdir(folder):
        match = CHECKPOINT_NAME.fullmatch(name)
        if not match or not (Path(folder) / name).is_dir():
            continue
        if holds_uncommitted_checkpoint(Path(folder) / name):
            skipped.append(os.path.join(folder, name))
        else:
            steps[name] = int(match.group(1))
    if not skipped:
        return original_function(trainer_utils, "get_last_checkpoint")(folder)
    last = os.path.join(folder, max(steps, key=steps.get)) if steps else None
    warn_skipped(sorted(skipped), last)
    return last


def rotate_keeping_committed(output_dir, save_total_limit=None, best_model_checkpoint=None, use_mtime=False,
                             checkpoint_prefix="checkpoint"):
    """`rotate_checkpoints` with the folders newer than every committed one left out of the count while
    their lazy checkpoints are uncommitted, so that the newest committed folder is never deleted for them."""
    original = sys.modules["transformers.trainer"].rotate_checkpoints.__wrapped__
    if save_total_limit is None or save_total_limit <= 0:
        return original(output_dir, save_total_limit, best_model_checkpoint, use_mtime, checkpoint_prefix)
    from transformers.trainer_utils import sort_checkpoints

    pending = 0
    for checkpoint in reversed(sort_checkpoints(output_dir, checkpoint_prefix, use_mtime)):
        if not holds_uncommitted_checkpoint(checkpoint):
            break
        pending += 1
    return original(output_dir, save_total_limit + pending, best_model_checkpoint, use_mtime, checkpoint_prefix)
