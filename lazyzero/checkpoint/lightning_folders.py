"""Lightning's `ckpt_path="last"` under lazy checkpoints (docs/checkpoint.md, "Under the trainers").

Lightning's DeepSpeed strategy saves each checkpoint as a folder of its own (`engine.save_checkpoint(folder,
tag="checkpoint")`). `ModelCheckpoint(save_last=True)` saves `last.ckpt` again at every save; with
`save_last="link"` it links `last.ckpt` to the folder just saved, before its lazy checkpoint is committed.
`fit(ckpt_path="last")` resumes from the newest of the `last*.ckpt` paths
(`ModelCheckpoint._find_last_checkpoints`). After a run killed during a background write such a path
can name a folder with no committed checkpoint (a link to it, or the first `last.ckpt`), which Lightning
refuses ("not a valid DeepSpeed checkpoint"); routed, it names the newest committed folder beside it
instead, or is left out when there is none (Lightning then starts afresh, with its own warning). A
`last.ckpt` saved again and killed keeps its previous, committed checkpoint, which loads as it is.
"""

from __future__ import annotations

import os

from lazyzero.checkpoint.trainer_folders import holds_uncommitted_checkpoint, newest_committed_folder, warn_skipped


def find_last_committed_checkpoints(self, trainer) -> set[str]:
    """`ModelCheckpoint._find_last_checkpoints`, each path that holds an uncommitted lazy checkpoint
    replaced by the newest committed folder beside it (or left out without one)."""
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

    found = set()
    for path in ModelCheckpoint._find_last_checkpoints.__wrapped__(self, trainer):
        if not holds_uncommitted_checkpoint(path):
            found.add(path)
            continue
        instead = newest_committed_folder(os.path.dirname(path))
        warn_skipped([path], instead)
        if instead is not None:
            found.add(os.path.normpath(instead))
    return found
