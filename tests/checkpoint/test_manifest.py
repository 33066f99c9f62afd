"""The manifest and the choice of tag to load, on small hand-made folders (no processes)."""

import json
import re

import pytest

from lazyzero.checkpoint.durable_io import hash_file
from lazyzero.checkpoint.folder_layout import MANIFEST_NAME, temp_dir, trash_dir
from lazyzero.checkpoint.manifest import (
    CheckpointDamagedError,
    Manifest,
    committed_tags,
    find_problems,
    list_checkpoints,
    read_manifest,
    resolve_tag_to_load,
    verify_checkpoint,
)

FILES = {"model.pt": b"model bytes " * 50, "optim/rank0.pt": bytes(range(256)) * 4}


def test_manifest_round_trips_through_its_file(tmp_path, make_checkpoint):
    written = make_checkpoint(tmp_path, "t1", FILES, created_unix=1_700_000_000.123456, global_steps=7, world_size=2)
    read = read_manifest(tmp_path / "t1")
    assert read == written
    assert read.total_bytes == sum(len(data) for data in FILES.values())
    assert verify_checkpoint(tmp_path / "t1") == written


@pytest.mark.parametrize("edit", ["size", "hash", "body_hash", "global_steps"])
def test_an_edited_manifest_fails_its_body_hash(tmp_path, make_checkpoint, edit):
    make_checkpoint(tmp_path, "t1", FILES, created_unix=1.0)
    path = tmp_path / "t1" / MANIFEST_NAME
    document = json.loads(path.read_bytes())
    stored_body_hash = document["body_hash"]
    if edit == "size":
        document["body"]["files"]["model.pt"]["size"] += 1
    elif edit == "hash":
        document["body"]["files"]["model.pt"]["hash"] = "0" * 32
    elif edit == "body_hash":
        document["body_hash"] = stored_body_hash = "f" * 32
    else:
        document["body"]["global_steps"] = 8
    path.write_text(json.dumps(document))
    with pytest.raises(CheckpointDamagedError,
                       match=re.escape(f"{path}: damaged; expected body hash {stored_body_hash}, found ")):
        read_manifest(tmp_path / "t1")


def test_a_manifest_of_another_format_is_refused_by_name(tmp_path, make_checkpoint):
    manifest = make_checkpoint(tmp_path, "t1", FILES, created_unix=1.0)
    (tmp_path / "t1" / MANIFEST_NAME).write_bytes(Manifest(**{**vars(manifest), "format": 2}).to_json())
    with pytest.raises(CheckpointDamagedError, match="format 2 with hash xxh3_128; this lazyzero reads format 1"):
        read_manifest(tmp_path / "t1")


@pytest.mark.parametrize("damage, expected_line", [
    ("deleted", "{path}: missing; expected {size} bytes"),
    ("truncated", "{path}: expected {size} bytes, found {found_size}"),
    ("emptied", "{path}: expected {size} bytes, found 0"),
    ("same size, other bytes", "{path}: expected xxh3_128 {hash}, found {found_hash} (contents changed)"),
])
def test_find_problems_names_the_file_what_was_expected_and_found(tmp_path, make_checkpoint, damage, expected_line):
    manifest = make_checkpoint(tmp_path, "t1", FILES, created_unix=1.0)
    path = tmp_path / "t1" / "optim" / "rank0.pt"
    entry = manifest.files["optim/rank0.pt"]
    if damage == "deleted":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(FILES["optim/rank0.pt"][:-3])
    elif damage == "emptied":
        path.write_bytes(b"")
    else:
        path.write_bytes(bytes(reversed(FILES["optim/rank0.pt"])))
    found_size, found_hash = hash_file(path) if path.exists() else (None, None)
    line = expected_line.format(path=path, size=entry["size"], hash=entry["hash"], found_size=found_size,
                                found_hash=found_hash)
    assert find_problems(tmp_path / "t1", manifest) == [line]
    with pytest.raises(CheckpointDamagedError, match="1 problem") as info:
        verify_checkpoint(tmp_path / "t1")
    assert line in str(info.value)


def test_find_problems_names_foreign_files_at_any_depth(tmp_path, make_checkpoint):
    manifest = make_checkpoint(tmp_path, "t1", FILES, created_unix=1.0)
    (tmp_path / "t1" / "stray.pt").write_bytes(b"x")
    (tmp_path / "t1" / "optim" / "rank1.pt").write_bytes(b"y")
    assert find_problems(tmp_path / "t1", manifest) == [
        (f"{tmp_path / 't1' / 'optim' / 'rank1.pt'}: not in the manifest (foreign file); "
         "expected only the 2 files it lists"),
        f"{tmp_path / 't1' / 'stray.pt'}: not in the manifest (foreign file); expected only the 2 files it lists",
    ]


def test_find_problems_without_hashes_sees_sizes_but_not_contents(tmp_path, make_checkpoint):
    manifest = make_checkpoint(tmp_path, "t1", FILES, created_unix=1.0)
    assert find_problems(tmp_path / "t1", manifest) == []
    (tmp_path / "t1" / "model.pt").write_bytes(b"X" * len(FILES["model.pt"]))
    assert find_problems(tmp_path / "t1", manifest, check_hashes=False) == []
    assert len(find_problems(tmp_path / "t1", manifest)) == 1


def _two_committed(save_dir, make_checkpoint):
    """'t10' committed before 't9': the order is by commit time, not by name."""
    make_checkpoint(save_dir, "t10", FILES, created_unix=100.0)
    make_checkpoint(save_dir, "t9", FILES, created_unix=200.0)


def test_resolve_loads_the_tag_latest_names(tmp_path, make_checkpoint):
    _two_committed(tmp_path, make_checkpoint)
    (tmp_path / "latest").write_text("t10")
    assert committed_tags(tmp_path) == ["t10", "t9"]
    assert resolve_tag_to_load(tmp_path) == ("t10", "")


@pytest.mark.parametrize("latest", ["gone", "half"])
def test_resolve_falls_back_to_the_newest_committed_when_latest_is_missing_or_uncommitted(tmp_path, make_checkpoint,
                                                                                          latest):
    _two_committed(tmp_path, make_checkpoint)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model.pt").write_bytes(b"partial")
    (tmp_path / "latest").write_text(latest)
    tag, warning = resolve_tag_to_load(tmp_path)
    assert tag == "t9"
    assert warning == (f"{tmp_path}: 'latest' names {latest!r}, which is missing or was never committed; "
                       "loading the newest committed checkpoint 't9' instead")


def test_resolve_without_latest_loads_the_newest_committed_and_says_why(tmp_path, make_checkpoint):
    _two_committed(tmp_path, make_checkpoint)
    assert resolve_tag_to_load(tmp_path) == (
        "t9", f"{tmp_path}: no 'latest' file; loading the newest committed checkpoint 't9' instead")


def test_resolve_with_nothing_committed(tmp_path):
    assert resolve_tag_to_load(tmp_path) == (
        None, f"{tmp_path}: no 'latest' file, and no committed lazyzero checkpoint was found")
    (tmp_path / "latest").write_text("gone")
    assert resolve_tag_to_load(tmp_path) == (
        None, f"{tmp_path}: 'latest' names 'gone', which is not a committed checkpoint, and no committed lazyzero "
              "checkpoint was found")


def test_resolve_keeps_a_plain_deepspeed_checkpoint_that_latest_names(tmp_path):
    """No manifest anywhere: a checkpoint plain DeepSpeed wrote; DeepSpeed's own 'latest' is followed."""
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "latest").write_text("global_step5")
    assert resolve_tag_to_load(tmp_path) == ("global_step5", "")


def test_leftover_folders_are_never_listed_even_with_a_manifest_inside(tmp_path, make_checkpoint):
    make_checkpoint(tmp_path, "t1", FILES, created_unix=1.0)
    make_checkpoint(tmp_path, temp_dir(tmp_path, "t2").name, FILES, created_unix=2.0)
    make_checkpoint(tmp_path, trash_dir(tmp_path, "t0").name, FILES, created_unix=3.0)
    assert [entry.tag for entry in list_checkpoints(tmp_path)] == ["t1"]
    assert resolve_tag_to_load(tmp_path)[0] == "t1"
