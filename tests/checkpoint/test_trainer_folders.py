"""The trainers' folder rules once `lazyzero.patch_deepspeed()` routed them
(lazyzero/checkpoint/trainer_folders.py), on hand-made checkpoint folders: an uncommitted lazy
checkpoint is never resumed from (the Hugging Face Trainer, transformers' example scripts, Lightning's
ckpt_path="last", Accelerate's load_state()) and never makes the Trainer's rotation delete the newest
committed folder."""

import os

import pytest

pytest.importorskip("transformers")

from transformers import trainer as trainer_module  # noqa: E402

# As transformers' example scripts bind it: at import, before lazyzero.patch_deepspeed() runs.
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import lazyzero  # noqa: E402
from lazyzero.checkpoint.accelerate_folders import newest_committed_state  # noqa: E402
from lazyzero.checkpoint.folder_layout import temp_dir  # noqa: E402
from lazyzero.checkpoint.trainer_folders import holds_uncommitted_checkpoint  # noqa: E402


@pytest.fixture
def routed():
    lazyzero.patch_deepspeed()
    yield
    lazyzero.unpatch_deepspeed()


def _trainer_folder(output_dir, step, make_checkpoint, committed: bool, name: str = "checkpoint-{step}",
                    tag: str = "global_step{step}"):
    """A trainer's folder (the Trainer's checkpoint-<step>/ by default) with a state file of the trainer's
    and a lazy tag, committed or still in its temporary folder."""
    folder = output_dir / name.format(step=step)
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    tag = tag.format(step=step)
    if committed:
        make_checkpoint(folder, tag, {"model.pt": b"x"}, created_unix=float(step))
        (folder / "latest").write_text(tag)
    else:
        temp_dir(folder, tag).mkdir()
        (temp_dir(folder, tag) / "model.pt").write_bytes(b"half")
    return folder


def test_resume_skips_a_folder_whose_lazy_checkpoint_is_uncommitted(tmp_path, make_checkpoint, routed):
    _trainer_folder(tmp_path, 2, make_checkpoint, committed=True)
    newest = _trainer_folder(tmp_path, 4, make_checkpoint, committed=False)
    assert holds_uncommitted_checkpoint(newest)
    assert trainer_module.get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    lazyzero.unpatch_deepspeed()
    assert trainer_module.get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")  # the Trainer's own


def test_the_example_scripts_name_bound_before_the_patch_skips_it_too(tmp_path, make_checkpoint, routed):
    _trainer_folder(tmp_path, 2, make_checkpoint, committed=True)
    _trainer_folder(tmp_path, 4, make_checkpoint, committed=False)
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-2" / "global_step2").rename(temp_dir(tmp_path / "checkpoint-2", "global_step2"))
    assert get_last_checkpoint(str(tmp_path)) is None  # nothing committed: start afresh, as without any folder


def test_rotation_keeps_the_newest_committed_folder_until_the_newer_one_commits(tmp_path, make_checkpoint, routed):
    _trainer_folder(tmp_path, 2, make_checkpoint, committed=True)
    _trainer_folder(tmp_path, 4, make_checkpoint, committed=False)
    trainer_module.rotate_checkpoints(str(tmp_path), save_total_limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    _trainer_folder(tmp_path, 6, make_checkpoint, committed=True)
    trainer_module.rotate_checkpoints(str(tmp_path), save_total_limit=1)
    # A committed newest folder: the Trainer's rule as it is (an older uncommitted leftover is deleted too).
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6"]


def test_unpatch_gives_the_trainer_its_own_functions_back(routed):
    from transformers import trainer_utils

    code = trainer_utils.get_last_checkpoint.__code__
    assert "lazyzero" in code.co_filename and trainer_module.rotate_checkpoints is not trainer_utils.rotate_checkpoints
    lazyzero.unpatch_deepspeed()
    assert trainer_module.get_last_checkpoint is trainer_utils.get_last_checkpoint
    assert trainer_utils.get_last_checkpoint.__code__.co_filename == trainer_utils.__file__
    assert trainer_module.rotate_checkpoints is trainer_utils.rotate_checkpoints


def _lightning_last(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=str(tmp_path), save_last="link")._find_last_checkpoints(None)


def test_lightnings_last_never_names_an_uncommitted_folder(tmp_path, make_checkpoint, routed):
    """ckpt_path="last" resumes from the newest last*.ckpt; one naming an uncommitted folder (a link made
    right after the save call returned, or a first last.ckpt cut short) gives way to the newest committed
    folder beside it (checkpoint/lightning_folders.py)."""
    pytest.importorskip("lightning")
    name, tag = "epoch={step}-step={step}.ckpt", "checkpoint"
    older = _trainer_folder(tmp_path, 2, make_checkpoint, committed=True, name=name, tag=tag)
    newer = _trainer_folder(tmp_path, 4, make_checkpoint, committed=False, name=name, tag=tag)
    os.symlink(newer.name, tmp_path / "last.ckpt")
    assert _lightning_last(tmp_path) == {str(older)}
    (tmp_path / "last.ckpt").unlink()
    os.symlink(older.name, tmp_path / "last.ckpt")
    assert _lightning_last(tmp_path) == {str(tmp_path / "last.ckpt")}  # committed: Lightning's own answer
    (tmp_path / "last.ckpt").unlink()
    (older / tag).rename(temp_dir(older, tag))
    os.symlink(newer.name, tmp_path / "last.ckpt")
    assert _lightning_last(tmp_path) == set()  # nothing committed: Lightning starts afresh, with its warning


def test_accelerates_newest_folder_is_the_newest_committed_one(tmp_path, make_checkpoint, routed):
    """load_state() with automatic naming loads the highest checkpoint_<i> (checkpoint/accelerate_folders.py)."""
    for step, committed in ((0, True), (1, True), (2, False)):
        _trainer_folder(tmp_path, step, make_checkpoint, committed, name="checkpoint_{step}", tag="pytorch_model")
    (tmp_path / "checkpoint_10").mkdir()  # Accelerate orders by number, not by name: a plain DeepSpeed folder
    assert newest_committed_state(tmp_path) == str(tmp_path / "checkpoint_10")
    (tmp_path / "checkpoint_10").rmdir()
    assert newest_committed_state(tmp_path) == str(tmp_path / "checkpoint_1")
    for step in (0, 1):
        (tmp_path / f"checkpoint_{step}" / "pytorch_model").rename(temp_dir(tmp_path / f"checkpoint_{step}",
                                                                            "pytorch_model"))
    with pytest.raises(ValueError, match="no folder holds a committed lazy checkpoint to load"):
        newest_committed_state(tmp_path)
