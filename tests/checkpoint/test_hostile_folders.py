"""Hostile checkpoint folders are refused before anything outside them is read, linked or copied, and
before any file is deserialized from bytes other than those verified (docs/reliability.md, guarantee 2)."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lazyzero.checkpoint.durable_io import hash_file
from lazyzero.checkpoint.engine_hooks import prepare_load
from lazyzero.checkpoint.folder_layout import MANIFEST_NAME, UnsafeCheckpointPath, check_tag, read_latest
from lazyzero.checkpoint.manifest import (
    CheckpointDamagedError,
    Manifest,
    find_problems,
    read_manifest,
    resolve_tag_to_load,
    verify_checkpoint,
)
from lazyzero.checkpoint.verified_read import VerifiedFiles
from lazyzero.cli import main
from lazyzero.config import validate_ds_config
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "hostile_load_worker.py"
SECRET = b"a file outside the checkpoint folder " * 7


def _ckpt(capsys, *argv) -> tuple[int, str, str]:
    status = main(["ckpt", *map(str, argv)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _manifest_listing(tag_dir: Path, entries: dict[str, dict]) -> None:
    """A manifest with a valid body hash that lists `entries` (relative path -> size, hash, rank)."""
    Manifest(tag=tag_dir.name, world_size=1, global_steps=1, files=entries, created_unix=1.0).write(tag_dir)


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside" / "secret.bin"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


@pytest.fixture
def save_dir(tmp_path) -> Path:
    root = tmp_path / "save"
    root.mkdir()
    return root


@pytest.mark.parametrize("listed", ["../../outside/secret.bin", "ABSOLUTE", "a/../../outside/secret.bin",
                                    "./model.pt", "a//b.pt"])
def test_a_manifest_listing_a_path_outside_its_folder_is_refused_before_any_file_is_touched(
        save_dir, outside, capsys, monkeypatch, listed):
    listed = str(outside) if listed == "ABSOLUTE" else listed
    tag_dir = save_dir / "t1"
    tag_dir.mkdir()
    _manifest_listing(tag_dir, {listed: {"size": len(SECRET), "hash": hash_file(outside)[1], "rank": 0}})
    (save_dir / "latest").write_text("t1")
    touched = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: (touched.append(str(path)), real_stat(path, *a, **k))[1])

    with pytest.raises(UnsafeCheckpointPath, match="must be a relative path inside the checkpoint folder"):
        read_manifest(tag_dir)
    with pytest.raises(UnsafeCheckpointPath):
        verify_checkpoint(tag_dir)
    status, out, _ = _ckpt(capsys, "verify", save_dir)
    assert status == 1 and "refused" in out and str(len(SECRET)) not in out
    export = save_dir.parent / "export"
    status, _, err = _ckpt(capsys, "export", save_dir, "--out", export)
    assert status == 1 and "damaged" in err and not export.exists()
    assert not [path for path in touched if "outside" in path]


def test_a_symbolic_link_inside_the_folder_is_a_problem_even_when_its_target_matches(save_dir, outside, capsys):
    tag_dir = save_dir / "t1"
    tag_dir.mkdir()
    (tag_dir / "model.pt").symlink_to(outside)
    (tag_dir / "optim").symlink_to(outside.parent, target_is_directory=True)
    _manifest_listing(tag_dir, {"model.pt": {"size": len(SECRET), "hash": hash_file(outside)[1], "rank": 0},
                                "optim/secret.bin": {"size": len(SECRET), "hash": hash_file(outside)[1], "rank": 0}})
    problems = find_problems(tag_dir, read_manifest(tag_dir))
    assert problems == [f"{tag_dir / 'model.pt'}: a symbolic link on the way; expected a plain file inside {tag_dir}",
                        f"{tag_dir / 'optim/secret.bin'}: a symbolic link on the way; expected a plain file inside "
                        f"{tag_dir}",
                        f"{tag_dir / 'optim'}: a symbolic link (to {outside.parent}); "
                        "a checkpoint folder holds plain folders and files only"]
    export = save_dir.parent / "export"
    status, _, _ = _ckpt(capsys, "export", save_dir, "t1", "--out", export)
    assert status == 1 and not export.exists()


def test_a_foreign_symbolic_link_is_reported_with_its_target(save_dir, outside, make_checkpoint):
    make_checkpoint(save_dir, "t1", {"model.pt": b"model"}, created_unix=1.0)
    (save_dir / "t1" / "extra.pt").symlink_to(outside)
    problems = find_problems(save_dir / "t1", read_manifest(save_dir / "t1"))
    assert problems == [f"{save_dir / 't1' / 'extra.pt'}: a symbolic link (to {outside}); "
                        "a checkpoint folder holds plain folders and files only"]


@pytest.mark.parametrize("latest", ["../outside", "/tmp", "a/b", ".hidden", "latest"])
def test_a_latest_file_leading_outside_the_folder_is_refused_naming_it(save_dir, make_checkpoint, capsys, latest):
    make_checkpoint(save_dir, "t1", {"model.pt": b"model"}, created_unix=1.0)
    (save_dir / "latest").write_text(latest)
    with pytest.raises(UnsafeCheckpointPath, match=f"{save_dir / 'latest'}: checkpoint tag"):
        read_latest(save_dir)
    with pytest.raises(UnsafeCheckpointPath):
        resolve_tag_to_load(save_dir)
    status, _, err = _ckpt(capsys, "verify", save_dir)
    assert status == 2 and f"{save_dir / 'latest'}: checkpoint tag {latest!r}" in err


@pytest.mark.parametrize("tag", ["../t1", "/abs", "a/b", ".t1", ""])
def test_tags_are_plain_folder_names(tag):
    with pytest.raises(UnsafeCheckpointPath, match="must be a plain folder name"):
        check_tag(tag)


def _engine(tmp_path, **checkpoint) -> SimpleNamespace:
    """What prepare_load reads of an engine, with lazy checkpoints off (no leftovers to clean)."""
    ds_config = {"train_micro_batch_size_per_gpu": 1, "lazyzero": {"checkpoint": checkpoint}}
    return SimpleNamespace(lazyzero_config=validate_ds_config(ds_config), global_rank=0)


def test_an_explicit_tag_leading_outside_is_refused_on_load(tmp_path, save_dir):
    with pytest.raises(UnsafeCheckpointPath):
        prepare_load(_engine(tmp_path), False, str(save_dir), "../elsewhere", VerifiedFiles())


def test_with_lazy_checkpoints_a_tag_without_manifest_is_refused_unless_allowed(tmp_path, save_dir):
    (save_dir / "plain").mkdir()
    (save_dir / "plain" / "model.pt").write_bytes(b"unverifiable")
    engine = _engine(tmp_path)
    engine.checkpoint_engine = SimpleNamespace(clean_leftovers=lambda *a, **k: None)
    with pytest.raises(CheckpointDamagedError, match="allow_unverified: true"):
        prepare_load(engine, True, str(save_dir), "plain", VerifiedFiles())
    allowed = _engine(tmp_path, allow_unverified=True)
    allowed.checkpoint_engine = engine.checkpoint_engine
    assert prepare_load(allowed, True, str(save_dir), "plain", VerifiedFiles()) == "plain"
    # Lazy checkpoints off (plain DeepSpeed saves, which have no manifest): loaded as DeepSpeed would.
    assert prepare_load(engine, False, str(save_dir), "plain", VerifiedFiles()) == "plain"


def test_a_file_changed_after_verification_is_not_deserialized(tmp_path, save_dir, make_checkpoint, monkeypatch):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.arange(4)}, path)
    make_checkpoint(save_dir, "t1", {"model.pt": path.read_bytes()}, created_unix=1.0)
    verified = VerifiedFiles()
    prepare_load(_engine(tmp_path), False, str(save_dir), "t1", verified)
    assert torch.equal(verified.load(save_dir / "t1" / "model.pt")["w"], torch.arange(4))

    torch.save({"w": torch.zeros(4, dtype=torch.long)}, save_dir / "t1" / "model.pt")  # after the check
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))
    with pytest.raises(CheckpointDamagedError, match="changed after the checkpoint was verified"):
        verified.load(save_dir / "t1" / "model.pt")
    assert loads == []
    verified.clear()
    monkeypatch.undo()
    assert torch.equal(verified.load(save_dir / "t1" / "model.pt")["w"], torch.zeros(4, dtype=torch.long))


def test_a_manifest_edited_to_list_an_outside_file_fails_its_body_hash_first(save_dir, make_checkpoint):
    make_checkpoint(save_dir, "t1", {"model.pt": b"model"}, created_unix=1.0)
    path = save_dir / "t1" / MANIFEST_NAME
    document = json.loads(path.read_bytes())
    document["body"]["files"]["../../outside/secret.bin"] = {"size": 1, "hash": "0" * 32, "rank": 0}
    path.write_text(json.dumps(document))
    with pytest.raises(CheckpointDamagedError, match="damaged; expected body hash"):
        read_manifest(save_dir / "t1")


class RunsCode:
    """Unpickling this calls `open`, creating a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# Lazy checkpoints off is the default suite; on (the lazy engine reads through the same VerifiedFiles) is slow.
LAZY_OFF_THEN_ON = ["0", pytest.param("1", marks=pytest.mark.slow)]


@pytest.mark.multiproc
@pytest.mark.parametrize("lazy", LAZY_OFF_THEN_ON)
def test_a_real_engine_refuses_a_model_file_that_would_run_code(tmp_path, lazy):
    """Lazy checkpoints off: DeepSpeed's own checkpoint engine reads the files (through the patch point);
    on: the lazy engine does, after the manifest was rewritten to match the hostile file."""
    save_dir = tmp_path / "save"
    proc = run_distributed("deepspeed", 1, [str(WORKER), "save", str(save_dir), lazy], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    model_file = next((save_dir / "step1").glob("*model_states.pt"))
    marker = tmp_path / "marker"
    torch.save({"module": RunsCode(marker)}, model_file)
    if lazy == "1":  # whoever can write the files can rewrite the manifest: its hash is not keyed
        manifest = read_manifest(save_dir / "step1")
        relpath = model_file.relative_to(save_dir / "step1").as_posix()
        manifest.files[relpath].update(size=model_file.stat().st_size, hash=hash_file(model_file)[1])
        manifest.write(save_dir / "step1")
    proc = run_distributed("deepspeed", 1, [str(WORKER), "load", str(save_dir), lazy], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((tmp_path / "load_result.json").read_text())
    assert result["error"] == "UnsafeCheckpointFile", result
    assert str(model_file) in result["message"] and "io.open" in result["message"]
    assert not marker.exists()


# The tag rule itself is in the default suite (test_tags_are_plain_folder_names above).
@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("lazy", ["0", "1"])
def test_a_save_tag_leading_outside_is_refused_before_anything_is_written(tmp_path, lazy):
    save_dir = tmp_path / "save"
    proc = run_distributed("deepspeed", 1, [str(WORKER), "save_outside", str(save_dir), lazy], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((tmp_path / "load_result.json").read_text())
    assert result["error"] == "UnsafeCheckpointPath" and "'../escaped'" in result["message"], result
    assert not (tmp_path / "escaped").exists()
