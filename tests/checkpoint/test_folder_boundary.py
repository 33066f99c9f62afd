"""The checkpoint folder is the boundary (docs/reliability.md, "Folders written by someone else"), on small
hand-made folders and the real `lazyzero ckpt` commands: a tag folder, 'latest' or a manifest that is a
symbolic link is refused without being followed; a damaged manifest of the tag 'latest' names is an
error, not a silent step back; a manifest whose hash matches but whose fields lie is refused naming the
field; every checkpoint file lazyzero reads goes through the safe loader. The same folders under a real
engine and `lazyzero train --resume`: test_folder_boundary_resume.py."""

import json
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lazyzero.checkpoint import manifest as manifest_module
from lazyzero.checkpoint.durable_io import new_hash, remove_tree
from lazyzero.checkpoint.engine_hooks import prepare_load
from lazyzero.checkpoint.folder_layout import (
    MANIFEST_NAME,
    SymbolicLinkRefused,
    leftover_dirs,
    read_latest,
    temp_dir,
)
from lazyzero.checkpoint.manifest import (
    FALL_BACK,
    CheckpointDamagedError,
    list_checkpoints,
    read_manifest,
    resolve_tag_to_load,
)
from lazyzero.checkpoint.rank_state import load_rank_state, rank_state_document, rank_state_path
from lazyzero.checkpoint.verified_read import VerifiedFiles
from lazyzero.cli import main
from lazyzero.config import validate_ds_config
from lazyzero.safe_load import OPT_OUT_KEY, UnreadableCheckpointFile, UnsafeCheckpointFile, load_checkpoint_file

DS_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def _ckpt(capsys, *argv) -> tuple[int, str, str]:
    status = main(["ckpt", *map(str, argv)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def two_tags(tmp_path, make_checkpoint) -> Path:
    """save/ with t1 (step 1) and t2 (step 2) committed, 'latest' = t2, real torch files in both."""
    save_dir = tmp_path / "save"
    for step, tag in ((1, "t1"), (2, "t2")):
        state = tmp_path / f"{tag}.pt"
        torch.save({"w": torch.full((4,), float(step))}, state)
        make_checkpoint(save_dir, tag, {DS_FILE: state.read_bytes()}, created_unix=float(step), global_steps=step)
    (save_dir / "latest").write_text("t2")
    return save_dir


def _move_outside(save_dir: Path, tag: str) -> Path:
    """The tag's folder moved out of save_dir (intact, manifest included) and a symbolic link left in its place."""
    outside = save_dir.parent / "outside" / tag
    outside.parent.mkdir(exist_ok=True)
    shutil.move(save_dir / tag, outside)
    (save_dir / tag).symlink_to(outside, target_is_directory=True)
    return outside


def _inodes(folder: Path) -> set[int]:
    return {p.stat().st_ino for p in folder.rglob("*") if p.is_file()}


# --- a tag folder that is a symbolic link --------------------------------------------------------

def test_a_symlinked_tag_is_refused_by_verify_ls_and_export_never_followed(two_tags, capsys):
    outside = _move_outside(two_tags, "t2")
    link_line = (f"{two_tags / 't2'}: a symbolic link (to {outside}); "
                 "a checkpoint folder holds plain folders and files only")

    for argv in (["verify", two_tags], ["verify", two_tags, "t2"]):
        status, out, _ = _ckpt(capsys, *argv)
        assert status == 1 and out.splitlines() == ["t2: DAMAGED (1 problem(s)):", f"  {link_line}"], out
    status, out, _ = _ckpt(capsys, "verify", two_tags, "--all")
    assert status == 1 and "t1: OK" in out and link_line in out

    status, out, _ = _ckpt(capsys, "ls", two_tags)
    row = next(line for line in out.splitlines() if line.startswith("t2 "))
    assert status == 0 and row.split()[:6] == ["t2", "-", "-", "-", "-", "DAMAGED:"] and "<- latest" in row
    assert f"warning: {two_tags}: the newest checkpoint, 't2', is damaged: {link_line}" in out

    export = two_tags.parent / "export"
    status, _, err = _ckpt(capsys, "export", two_tags, "--out", export)
    assert status == 1 and "not exporting t2: it is damaged" in err and not export.exists()
    assert _ckpt(capsys, "export", two_tags, "t1", "--out", export)[0] == 0
    assert not _inodes(export) & _inodes(outside)


def test_resume_refuses_a_symlinked_latest_tag_or_falls_back_saying_so(two_tags):
    _move_outside(two_tags, "t2")
    with pytest.raises(CheckpointDamagedError, match="the newest checkpoint, 't2', is damaged: .*a symbolic link"):
        resolve_tag_to_load(two_tags)
    tag, warning = resolve_tag_to_load(two_tags, FALL_BACK)
    assert tag == "t1" and "'t2', is DAMAGED" in warning and "loading the older checkpoint 't1' instead" in warning


def _engine(**checkpoint) -> SimpleNamespace:
    """What prepare_load reads of an engine, with lazy checkpoints off (no leftovers to clean)."""
    ds_config = {"train_micro_batch_size_per_gpu": 1, "lazyzero": {"checkpoint": checkpoint}}
    return SimpleNamespace(lazyzero_config=validate_ds_config(ds_config), global_rank=0)


def test_a_load_refuses_a_symlinked_tag_by_name_and_from_latest_unless_falling_back(two_tags, capsys):
    _move_outside(two_tags, "t2")
    with pytest.raises(SymbolicLinkRefused, match=re.escape(f"{two_tags / 't2'}: a symbolic link")):
        prepare_load(_engine(), False, str(two_tags), "t2", VerifiedFiles())
    with pytest.raises(CheckpointDamagedError, match="the newest checkpoint, 't2', is damaged: .*a symbolic link"):
        prepare_load(_engine(), False, str(two_tags), None, VerifiedFiles())
    verified = VerifiedFiles()
    assert prepare_load(_engine(on_damaged_latest="fall_back"), False, str(two_tags), None, verified) == "t1"
    assert "the newest checkpoint, 't2', is DAMAGED: " in capsys.readouterr().out
    assert torch.equal(verified.load(two_tags / "t1" / DS_FILE)["w"], torch.full((4,), 1.0))


# --- 'latest' and a manifest that are symbolic links ----------------------------------------------

def test_a_symlinked_latest_is_refused_even_when_it_names_a_committed_tag(two_tags, capsys):
    pointer = two_tags.parent / "pointer"
    pointer.write_text("t1")  # a roll-back to an older committed tag
    (two_tags / "latest").unlink()
    (two_tags / "latest").symlink_to(pointer)
    message = f"{two_tags / 'latest'}: a symbolic link (to {pointer})"
    for read in (read_latest, resolve_tag_to_load):
        with pytest.raises(SymbolicLinkRefused, match=re.escape(message)):
            read(two_tags)
    for argv in (["verify", two_tags], ["export", two_tags, "--out", two_tags.parent / "export"]):
        status, out, err = _ckpt(capsys, *argv)
        assert status == 2 and message in err and "OK" not in out
    status, out, err = _ckpt(capsys, "ls", two_tags)  # the tags are listed, then the refusal
    assert status == 2 and "t1 " in out and "<- latest" not in out and message in err
    assert not (two_tags.parent / "export").exists()


def test_a_symlinked_manifest_is_refused_before_it_is_parsed(two_tags, capsys, monkeypatch):
    manifest = two_tags / "t2" / MANIFEST_NAME
    copy = two_tags.parent / "manifest.json"
    shutil.move(manifest, copy)
    manifest.symlink_to(copy)
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(manifest_module.json, "loads", lambda data, *a, **k: (parsed.append(data), real_loads(data))[1])
    with pytest.raises(SymbolicLinkRefused, match=f"{manifest}: a symbolic link"):
        read_manifest(two_tags / "t2")
    status, out, _ = _ckpt(capsys, "verify", two_tags)
    assert status == 1 and f"{manifest}: a symbolic link (to {copy})" in out
    assert copy.read_bytes() not in parsed


def test_a_file_swapped_for_a_link_after_verification_is_not_read(two_tags, tmp_path):
    verified = VerifiedFiles()
    verified.expect(two_tags / "t2", read_manifest(two_tags / "t2"))
    path = two_tags / "t2" / DS_FILE
    assert torch.equal(verified.load(path)["w"], torch.full((4,), 2.0))
    shutil.copyfile(path, tmp_path / "same_bytes.pt")
    path.unlink()
    path.symlink_to(tmp_path / "same_bytes.pt")  # the same bytes: only the link gives it away
    with pytest.raises(SymbolicLinkRefused, match=f"{path}: a symbolic link"):
        verified.load(path)
    verified.expect(two_tags / "t2", None)  # a tag without manifest is read through the same open
    with pytest.raises(SymbolicLinkRefused):
        verified.load(path)


def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(two_tags, capsys):
    path = two_tags / "t2" / DS_FILE
    path.unlink()
    os.mkfifo(path)
    os.mkfifo(two_tags / "t2" / "extra.pt")
    status, out, _ = _ckpt(capsys, "verify", two_tags)
    assert status == 1 and f"{path}: not a regular file (a FIFO)" in out
    assert f"{two_tags / 't2' / 'extra.pt'}: not in the manifest (foreign file)" in out


# --- a damaged manifest of the tag 'latest' names --------------------------------------------------

def _flip_bit(data: bytes) -> bytes:
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x08
    return bytes(damaged)


def _absurd_size(data: bytes) -> bytes:
    document = json.loads(data)
    document["body"]["files"][DS_FILE]["size"] = 10**30
    return json.dumps(document).encode()


@pytest.mark.parametrize("damage, found", [
    (lambda data: b"", "found unreadable content"),
    (lambda data: data[:-40], "found unreadable content"),
    (_flip_bit, "damaged; expected "),
    (_absurd_size, "damaged; expected body hash"),
], ids=["empty", "invalid JSON", "bit flipped", "absurd size"])
def test_a_damaged_manifest_of_the_latest_tag_fails_verify_and_export(two_tags, capsys, damage, found):
    manifest = two_tags / "t2" / MANIFEST_NAME
    manifest.write_bytes(damage(manifest.read_bytes()))

    status, out, _ = _ckpt(capsys, "verify", two_tags)
    assert status == 1 and out.startswith("t2: DAMAGED (1 problem(s)):") and f"  {manifest}: " in out
    assert found in out and "t1" not in out
    status, out, _ = _ckpt(capsys, "ls", two_tags)
    row = next(line for line in out.splitlines() if line.startswith("t2 "))
    assert status == 0 and "DAMAGED: lazyzero_manifest.json: " in row and "<- latest" in row
    assert f"warning: {two_tags}: the newest checkpoint, 't2', is damaged: {manifest}: " in out
    status, _, err = _ckpt(capsys, "export", two_tags, "--out", two_tags.parent / "export")
    assert status == 1 and "not exporting t2: it is damaged" in err

    with pytest.raises(CheckpointDamagedError) as stopped:
        resolve_tag_to_load(two_tags)
    assert str(stopped.value).startswith(f"{two_tags}: the newest checkpoint, 't2', is damaged: {manifest}: ")
    assert "to resume from the newest other committed one, 't1', set lazyzero.checkpoint.on_damaged_latest: " \
           "fall_back" in str(stopped.value)
    tag, warning = resolve_tag_to_load(two_tags, FALL_BACK)
    assert tag == "t1" and f"the newest checkpoint, 't2', is DAMAGED: {manifest}: " in warning


def test_a_manifest_too_large_to_be_one_is_refused_unread(two_tags, capsys, monkeypatch):
    monkeypatch.setattr(manifest_module, "MANIFEST_MAX_BYTES", 64)
    manifest = two_tags / "t2" / MANIFEST_NAME
    size = manifest.stat().st_size
    status, out, _ = _ckpt(capsys, "verify", two_tags)
    assert status == 1 and f"{manifest}: {size:,} bytes; expected at most 64" in out


# --- a manifest whose hash matches but whose fields lie --------------------------------------------

def _rewrite_body(tag_dir: Path, edit) -> Path:
    """Edit the manifest's body and recompute its hash, as anyone who can write the folder can."""
    path = tag_dir / MANIFEST_NAME
    document = json.loads(path.read_bytes())
    edit(document["body"])
    digest = new_hash()
    digest.update(json.dumps(document["body"], sort_keys=True).encode())
    document["body_hash"] = digest.hexdigest()
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("edit, field_problem", [
    (lambda body: body["files"][DS_FILE].update(size=str(body["files"][DS_FILE]["size"])),
     f"files.{DS_FILE}.size: input should be a valid integer, found '"),
    (lambda body: body.pop("world_size"), "world_size: missing"),
    (lambda body: body.update(files=[DS_FILE]), "files: input should be a valid dictionary, found ['"),
    (lambda body: body["files"][DS_FILE].update(hash="../../etc"), f"files.{DS_FILE}.hash: string should match"),
    (lambda body: body["files"][DS_FILE].update(size=-1), f"files.{DS_FILE}.size: input should be greater than "),
    (lambda body: body["files"][DS_FILE].update(rank=3), f"files.{DS_FILE}.rank is 3; expected a rank below "),
    (lambda body: body.update(extra=1), "extra: extra inputs are not permitted"),
    (lambda body: body.update(tag="t1"), "it was committed as tag 't1' but is in the folder 't2'"),
], ids=["size as string", "no world_size", "files a list", "hash not hex", "negative size", "rank beyond world",
        "unknown field", "renamed tag"])
def test_a_manifest_that_lies_is_refused_naming_the_file_and_field(two_tags, capsys, edit, field_problem):
    path = _rewrite_body(two_tags / "t2", edit)
    with pytest.raises(CheckpointDamagedError) as refused:
        read_manifest(two_tags / "t2")
    assert str(refused.value).startswith(f"{path}: refused: ") and field_problem in str(refused.value)

    for argv in (["verify", two_tags], ["verify", two_tags, "--all"],
                 ["export", two_tags, "t2", "--out", two_tags.parent / "export"]):
        status, out, err = _ckpt(capsys, *argv)
        assert status == 1 and field_problem in out and "Traceback" not in out + err
    status, out, _ = _ckpt(capsys, "ls", two_tags)
    row = next(line for line in out.splitlines() if line.startswith("t2 "))
    assert status == 0 and "DAMAGED: lazyzero_manifest.json: refused: " in row and field_problem in row
    assert [entry.tag for entry in list_checkpoints(two_tags) if entry.damaged] == ["t2"]


# --- every file through the safe loader -------------------------------------------------------------

class RunsCode:
    """Unpickling this calls `open`, creating a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_rank_state_file_that_would_run_code_is_refused_naming_it(tmp_path):
    marker = tmp_path / "marker"
    path = rank_state_path(tmp_path, 0)
    torch.save({**rank_state_document(0, 1, {}), "payload": RunsCode(marker)}, path)
    with pytest.raises(UnsafeCheckpointFile) as refused:
        load_rank_state(tmp_path, 0, 1)
    assert str(refused.value).startswith(f"{path}: refusing to load") and OPT_OUT_KEY in str(refused.value)
    assert "weights_only" not in str(refused.value) and not marker.exists()
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match=f"{path}: format 'list'"):
        load_rank_state(tmp_path, 0, 1)


@pytest.mark.parametrize("content, found", [
    (b"", "EOFError"), (b"hello world" * 8, "KeyError"), ("truncated", "RuntimeError"),
])
def test_a_file_torch_cannot_read_is_named_with_what_to_do(tmp_path, content, found):
    path = tmp_path / "file.pt"
    torch.save({"w": torch.ones(8)}, path)
    path.write_bytes(path.read_bytes()[:100] if content == "truncated" else content)
    for options in ({}, {"mmap": True}):
        with pytest.raises(UnreadableCheckpointFile) as unreadable:
            load_checkpoint_file(path, "cpu", **options)
        message = str(unreadable.value)
        assert message.startswith(f"{path}: cannot be read as a torch checkpoint file ({found}") and \
            "lazyzero ckpt verify" in message


def test_a_legacy_format_file_loads_where_memory_mapping_was_asked(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.arange(5)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint_file(path, "cpu", mmap=True)["w"], torch.arange(5))
    marker = tmp_path / "marker"
    torch.save([RunsCode(marker)], path, _use_new_zipfile_serialization=False)
    with pytest.raises(UnsafeCheckpointFile, match=f"{path}: refusing to load a checkpoint file that holds io.open"):
        load_checkpoint_file(path, "cpu", mmap=True)
    assert not marker.exists()


def test_a_leftover_named_link_is_removed_itself_never_its_target(two_tags, tmp_path):
    target = tmp_path / "keep"
    target.mkdir()
    (target / "file").write_text("mine")
    temp_dir(two_tags, "t3").symlink_to(target, target_is_directory=True)
    assert leftover_dirs(two_tags) == [temp_dir(two_tags, "t3")]
    remove_tree(temp_dir(two_tags, "t3"))
    assert not os.path.lexists(temp_dir(two_tags, "t3")) and (target / "file").read_text() == "mine"
