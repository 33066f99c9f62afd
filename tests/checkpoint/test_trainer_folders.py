"""The Hugging Face Trainer's folder rules once `lazyzero.patch_deepspeed()` routed them
(lazyzero/checkpoint/trainer_folders.py), on hand-made `checkpoint-N/` folders: an uncommitted lazy
checkpoint is never resumed from and never makes rotation delete the newest committed folder."""

import pytest

pytest.importorskip("transformers")

from transformers import trainer as trainer_module  # noqa: E402

import lazyzero  # noqa: E402
from lazyzero.checkpoint.folder_layout import temp_dir  # noqa: E402
from lazyzero.checkpoint.trainer_folders import holds_uncommitted_checkpoint  # noqa: E402


@pytest.fixture
def routed():
    lazyzero.patch_deepspeed()
    yield
    lazyzero.unpatch_deepspeed()


def _trainer_folder(output_dir, step, make_checkpoint, committed: bool):
    """checkpoint-<step>/ with the Trainer's state file and a lazy tag, committed or still in its temporary folder."""
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    tag = f"global_step{step}"
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

    assert trainer_module.get_last_checkpoint is not trainer_utils.get_last_checkpoint
    lazyzero.unpatch_deepspeed()
    assert trainer_module.get_last_checkpoint is trainer_utils.get_last_checkpoint
    assert trainer_module.rotate_checkpoints is trainer_utils.rotate_checkpoints
