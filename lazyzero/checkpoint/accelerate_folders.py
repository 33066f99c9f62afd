"""Accelerate's `load_state()` of the newest folder under lazy checkpoints (docs/checkpoint.md, "Under
the trainers").

With `ProjectConfiguration(automatic_checkpoint_naming=True)`, `Accelerator.save_state()` saves into
`project_dir/checkpoints/checkpoint_<i>/` (DeepSpeed's engine writes its tag `pytorch_model` there, beside
Accelerate's own files: every rank's random states, samplers, scalers), and `load_state()` without a
folder loads the one with the highest i. After a run killed during a background write that folder
holds Accelerate's files but no committed checkpoint. Routed, `load_state()` loads the newest folder
whose lazy checkpoint is committed, so that the model, the optimizer and Accelerate's states all come
from one save.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lazyzero.checkpoint.trainer_folders import holds_uncommitted_checkpoint, warn_skipped

FOLDER_NUMBER = re.compile(r"([0-9]+)(?=[^/]*$)")  # Accelerate's order of its folders (Accelerator.load_state)


def newest_committed_state(checkpoints: str | os.PathLike) -> str:
    """The folder of `checkpoints` with the highest number whose lazy checkpoint is not uncommitted;
    ValueError naming the folders passed over when there is none."""
    folders = sorted((path for path in Path(checkpoints).iterdir() if FOLDER_NUMBER.search(path.name)),
                     key=lambda path: int(FOLDER_NUMBER.search(path.name).group(1)))
    skipped = [str(path) for path in folders if holds_uncommitted_checkpoint(path)]
    loadable = [str(path) for path in folders if str(path) not in skipped]
    if skipped:
        warn_skipped(skipped, loadable[-1] if loadable else None)
    if not loadable:
        raise ValueError(f"{checkpoints}: no folder holds a committed lazy checkpoint to load "
                         f"({', '.join(skipped) or 'none saved'}); start without load_state()")
    return loadable[-1]


def load_newest_committed_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
    """`Accelerator.load_state`; without `input_dir` under automatic checkpoint naming, from the newest
    folder whose lazy checkpoint is committed."""
    from accelerate import Accelerator

    if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
        input_dir = newest_committed_state(os.path.join(self.project_dir, "checkpoints"))
    return Accelerator.load_state.__wrapped__(self, input_dir, load_kwargs, **load_model_func_kwargs)
