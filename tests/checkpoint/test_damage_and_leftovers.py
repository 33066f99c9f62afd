"""docs/reliability.md, what is tested and 7 on a real 2-rank lazy checkpoint (tests/checkpoint/conftest.py).

Row 2: every injected fault (flipped bit, truncated, emptied, deleted, foreign or swapped shard,
damaged manifest) is caught, and the error names the file, what was expected and what was found;
a clean copy raises nothing. A resume from a damaged tag fails instead of loading something else.
Row 7: leftover temporary and trash folders are never listed and are removed at start with a
warning; a 'latest' naming a missing tag resumes from the newest committed one, with a warning.
"""

import json
import shutil

import pytest

from lazyzero.checkpoint.durable_io import hash_file
from lazyzero.checkpoint.folder_layout import MANIFEST_NAME, temp_dir, trash_dir
from lazyzero.checkpoint.manifest import CheckpointDamagedError, committed_tags, list_checkpoints, verify_checkpoint

pytestmark = pytest.mark.multiproc  # everything here uses the session's 2-rank run

TAG = "step4"
OPTIM_RANK0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
OPTIM_RANK1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
SHARDS = [OPTIM_RANK1, "zero_pp_rank_0_mp_rank_00_model_states.pt", "lazyzero_rank00001.pt"]


@pytest.fixture
def save_dir(tmp_path, lazy_checkpoint_dir):
    return shutil.copytree(lazy_checkpoint_dir, tmp_path / "save")


def _expected(save_dir, relpath: str) -> dict:
    return json.loads((save_dir / TAG / MANIFEST_NAME).read_bytes())["body"]["files"][relpath]


def _damage_message(tag_dir) -> str:
    with pytest.raises(CheckpointDamagedError) as info:
        verify_checkpoint(tag_dir)
    return str(info.value)


def test_clean_copies_verify_without_a_false_alarm(save_dir):
    for step, tag in ((2, "step2"), (4, "step4")):
        manifest = verify_checkpoint(save_dir / tag)
        assert (manifest.tag, manifest.global_steps, manifest.world_size) == (tag, step, 2)
        assert sorted(manifest.files) == sorted(p.name for p in (save_dir / tag).iterdir() if p.name != MANIFEST_NAME)


@pytest.mark.parametrize("relpath", SHARDS)
@pytest.mark.parametrize("where, mask", [("start", 0x80), ("middle", 0x10), ("end", 0x01)])
def test_one_flipped_bit_names_the_file_and_both_hashes(save_dir, relpath, where, mask):
    path = save_dir / TAG / relpath
    data = bytearray(path.read_bytes())
    data[{"start": 0, "middle": len(data) // 2, "end": len(data) - 1}[where]] ^= mask
    path.write_bytes(data)
    found = hash_file(path)[1]
    message = _damage_message(save_dir / TAG)
    assert (f"{path}: expected xxh3_128 {_expected(save_dir, relpath)['hash']}, found {found} "
            "(contents changed)") in message
    assert "1 problem(s)" in message


@pytest.mark.parametrize("damage", ["truncated", "emptied", "deleted"])
def test_a_short_or_missing_shard_names_the_file_and_both_sizes(save_dir, damage):
    path = save_dir / TAG / OPTIM_RANK1
    size = _expected(save_dir, OPTIM_RANK1)["size"]
    if damage == "deleted":
        path.unlink()
        expected_line = f"{path}: missing; expected {size} bytes"
    else:
        kept = size - 4096 if damage == "truncated" else 0
        path.write_bytes(path.read_bytes()[:kept])
        expected_line = f"{path}: expected {size} bytes, found {kept}"
    assert expected_line in _damage_message(save_dir / TAG)


def test_a_foreign_shard_is_named(save_dir):
    """A shard of a larger world (rank 2) left in the tag folder is not silently accepted."""
    foreign = save_dir / TAG / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.copyfile(save_dir / TAG / OPTIM_RANK1, foreign)
    assert (f"{foreign}: not in the manifest (foreign file); expected only the 6 files it lists"
            in _damage_message(save_dir / TAG))


def test_shards_swapped_between_ranks_are_both_named(save_dir):
    rank0, rank1 = save_dir / TAG / OPTIM_RANK0, save_dir / TAG / OPTIM_RANK1
    hash0, hash1 = _expected(save_dir, OPTIM_RANK0)["hash"], _expected(save_dir, OPTIM_RANK1)["hash"]
    rank0.rename(save_dir / "swap")
    rank1.rename(rank0)
    (save_dir / "swap").rename(rank1)
    message = _damage_message(save_dir / TAG)
    assert f"{rank0}: expected xxh3_128 {hash0}, found {hash1}" in message
    assert f"{rank1}: expected xxh3_128 {hash1}, found {hash0}" in message


def test_a_flipped_bit_anywhere_in_the_manifest_is_caught(save_dir):
    """One bit per byte, the bit cycling with the position: every byte of the manifest, every bit rank."""
    path = save_dir / TAG / MANIFEST_NAME
    clean = path.read_bytes()
    missed = []
    for position in range(len(clean)):
        damaged = bytearray(clean)
        damaged[position] ^= 1 << (position % 8)
        path.write_bytes(damaged)
        try:
            verify_checkpoint(save_dir / TAG)
            missed.append(position)
        except CheckpointDamagedError as err:
            assert str(err).startswith(f"{path}: damaged; expected "), err
    assert missed == []


@pytest.mark.parametrize("damage, expected", [
    ("truncated", "damaged; expected a lazyzero manifest (JSON with body and body_hash), found unreadable content"),
    ("deleted", "missing; expected the manifest of a committed lazyzero checkpoint"),
])
def test_a_truncated_or_deleted_manifest_is_named(save_dir, damage, expected):
    path = save_dir / TAG / MANIFEST_NAME
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert _damage_message(save_dir / TAG).startswith(f"{path}: {expected}")


def _add_leftovers(save_dir):
    """What crashes leave: a complete-looking temporary folder (manifest included) and a half-deleted one."""
    leftovers = [shutil.copytree(save_dir / "step4", temp_dir(save_dir, "step6")),
                 shutil.copytree(save_dir / "step2", trash_dir(save_dir, "step2"))]
    (leftovers[1] / OPTIM_RANK0).unlink()
    return leftovers


# A resume removing what a crash left is in the default suite: tests/checkpoint/test_crash_failpoints.py.
@pytest.mark.slow
def test_resume_skips_a_missing_latest_and_removes_leftovers_with_warnings(save_dir, tmp_path, lazy_train,
                                                                           read_run_metrics):
    (save_dir / "latest").write_text("step9")
    leftovers = _add_leftovers(save_dir)
    assert [entry.tag for entry in list_checkpoints(save_dir)] == committed_tags(save_dir) == ["step2", "step4"]

    proc = lazy_train(tmp_path / "resumed", save_dir, "--resume", "--max-steps", "5")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert ("'latest' names 'step9', which is missing or was never committed; "
            "loading the newest committed checkpoint 'step4' instead") in proc.stdout
    for leftover in leftovers:
        assert f"lazyzero: removing {leftover.resolve()}, left by an interrupted checkpoint" in proc.stdout
        assert not leftover.exists()
    assert [record["step"] for record in read_run_metrics(tmp_path / "resumed")] == [5]


def test_resume_from_a_damaged_shard_fails_naming_the_file(save_dir, tmp_path, lazy_train):
    """The damaged tag is the one 'latest' names; loading the older step2 instead would be a silent substitution."""
    path = save_dir / TAG / OPTIM_RANK1
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(data)

    logs = tmp_path / "rank_logs"
    proc = lazy_train(tmp_path / "resumed", save_dir, "--resume", "--max-steps", "5", rank_logs=logs)
    rank0, rank1 = (next(logs.glob(f"*_rank{rank}.log")).read_text() for rank in (0, 1))
    assert proc.returncode != 0
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()
    # One line, the last rank 0 prints: the file, what was expected and found (distributed/refusal_line.py).
    refusal = rank0.strip().splitlines()[-1]
    # It says that the newest checkpoint, the one a resume picks, is damaged, and names the older one it
    # could load instead (lazyzero.checkpoint.on_damaged_latest: stop, the default).
    assert refusal.startswith(f"lazyzero: CheckpointDamagedError: {save_dir}: the newest checkpoint, {TAG!r}, "
                              f"is damaged: checkpoint {save_dir / TAG} is damaged (1 problem(s)): {path}: "
                              "expected xxh3_128 "), rank0[-3000:]
    # Rank 1 refused the same way (every rank verifies the whole tag): from the launcher's view the message
    # reads once, and rank 1's last line points to rank 0's.
    assert rank1.strip().splitlines()[-1] == ("lazyzero: rank 1 stopped on the same refusal as rank 0 "
                                              "(CheckpointDamagedError); rank 0 prints it"), rank1[-3000:]
    assert (proc.stdout + rank0 + rank1).count(f"{path}: expected xxh3_128 ") == 1, rank0[-3000:]
