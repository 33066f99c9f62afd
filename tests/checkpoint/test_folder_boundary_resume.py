"""Hostile and damaged checkpoint folders under a real engine's load_checkpoint (1 rank, the deepspeed
launcher: tests/checkpoint/boundary_resume_worker.py) and under `lazyzero train --resume` (2 ranks, the
session's run: tests/checkpoint/conftest.py). docs/reliability.md, "Folders written by someone else":
a resume never reads through a symbolic link, never steps back to an older checkpoint without saying
which file is damaged, and does so only with `on_damaged_latest: fall_back`; no file runs code."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from lazyzero.checkpoint.durable_io import hash_file, new_hash
from lazyzero.checkpoint.folder_layout import MANIFEST_NAME
from lazyzero.checkpoint.manifest import read_manifest
from lazyzero.cli import main
from lazyzero.safe_load import load_checkpoint_file
from lazyzero.testing import EXACT, run_distributed

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "boundary_resume_worker.py"
LAZY_CONFIG = ROOT / "ds_configs" / "cpu_demo_lazy_ckpt.json"
RANK_STATE = "lazyzero_rank00000.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class RunsCode:
    """Unpickling this calls `open`, creating a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(data)


def _replace_listed_file(save_dir: Path, relpath: str, write) -> None:
    """Rewrite a file of step2 and its manifest entry, as anyone who can write the folder can."""
    path = save_dir / "step2" / relpath
    write(path)
    manifest = read_manifest(save_dir / "step2")
    manifest.files[relpath].update(size=path.stat().st_size, hash=hash_file(path)[1])
    manifest.write(save_dir / "step2")


def _tag_link(save_dir: Path) -> None:
    outside = save_dir.parent / "outside_step2"
    shutil.move(save_dir / "step2", outside)
    (save_dir / "step2").symlink_to(outside, target_is_directory=True)


def _latest_link(save_dir: Path) -> None:
    pointer = save_dir.parent / "pointer"
    pointer.write_text("step1")
    (save_dir / "latest").unlink()
    (save_dir / "latest").symlink_to(pointer)


def _manifest_lies(save_dir: Path) -> None:
    path = save_dir / "step2" / MANIFEST_NAME
    document = json.loads(path.read_bytes())
    del document["body"]["world_size"]
    digest = new_hash()
    digest.update(json.dumps(document["body"], sort_keys=True).encode())
    document["body_hash"] = digest.hexdigest()
    path.write_text(json.dumps(document))


def _hostile_rank_state(save_dir: Path) -> None:
    marker = save_dir.parent / "marker"
    _replace_listed_file(save_dir, RANK_STATE, lambda path: torch.save(
        {**torch.load(path, weights_only=True), "payload": RunsCode(marker)}, path))


def _legacy_rank_state(save_dir: Path) -> None:
    _replace_listed_file(save_dir, RANK_STATE, lambda path: torch.save(
        torch.load(path, weights_only=True), path, _use_new_zipfile_serialization=False))


VARIANTS = {
    "intact": lambda save_dir: None,
    "tag_link": _tag_link,
    "latest_link": _latest_link,
    "manifest_flipped": lambda save_dir: _flip_bit(save_dir / "step2" / MANIFEST_NAME),
    "manifest_lies": _manifest_lies,
    "shard_flipped": lambda save_dir: _flip_bit(save_dir / "step2" / OPTIM),
    "rank_state_runs_code": _hostile_rank_state,
    "rank_state_legacy_format": _legacy_rank_state,
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict:
    """Every variant's load under each setting: {variant: {setting: result}}, and the variants' folders."""
    work = tmp_path_factory.mktemp("boundary")
    proc = run_distributed("deepspeed", 1, [str(WORKER), "save", str(work / "saved")], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    dirs = {}
    for name, damage in VARIANTS.items():
        (work / name).mkdir()
        dirs[name] = shutil.copytree(work / "saved", work / name / "save")
        damage(dirs[name])
    result_file = work / "results.json"
    proc = run_distributed("deepspeed", 1, [str(WORKER), "load", str(result_file), *map(str, dirs.values())],
                           timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    by_dir = json.loads(result_file.read_text())
    results = {name: {setting: by_dir[setting][str(path)] for setting in by_dir} for name, path in dirs.items()}
    return {"results": results, "dirs": dirs}


def test_an_intact_folder_resumes_from_latest_under_both_settings(resumed):
    for result in resumed["results"]["intact"].values():
        assert (result["error"], result["tag"], result["step"], result["printed"]) == (None, "step2", 2, ""), result


@pytest.mark.parametrize("variant, damaged_file", [
    ("tag_link", "step2"), ("manifest_flipped", f"step2/{MANIFEST_NAME}"), ("manifest_lies", f"step2/{MANIFEST_NAME}"),
    ("shard_flipped", f"step2/{OPTIM}"),
])
def test_a_damaged_latest_stops_the_resume_or_falls_back_saying_which_file(resumed, variant, damaged_file):
    save_dir, results = resumed["dirs"][variant], resumed["results"][variant]
    stopped = results["stop"]
    assert stopped["error"] == "CheckpointDamagedError", stopped
    assert stopped["message"].startswith(f"{save_dir}: the newest checkpoint, 'step2', is damaged: ")
    assert str(save_dir / damaged_file) in stopped["message"]
    assert "to resume from the newest other committed one, 'step1', set lazyzero.checkpoint.on_damaged_latest: " \
           "fall_back" in stopped["message"]
    fell_back = results["fall_back"]
    assert (fell_back["error"], fell_back["tag"], fell_back["step"]) == (None, "step1", 1), fell_back
    assert f"{save_dir}: the newest checkpoint, 'step2', is DAMAGED: " in fell_back["printed"]
    assert str(save_dir / damaged_file) in fell_back["printed"]
    assert "loading the older checkpoint 'step1' instead (lazyzero.checkpoint.on_damaged_latest: fall_back)" in \
        fell_back["printed"]


def test_a_symlinked_latest_is_refused_whatever_the_setting(resumed):
    save_dir = resumed["dirs"]["latest_link"]
    for result in resumed["results"]["latest_link"].values():
        assert result["error"] == "SymbolicLinkRefused", result
        pointer = save_dir.parent / "pointer"
        assert result["message"].startswith(f"{save_dir / 'latest'}: a symbolic link (to {pointer})")


def test_a_rank_state_file_that_would_run_code_is_refused_naming_it(resumed):
    save_dir = resumed["dirs"]["rank_state_runs_code"]
    for result in resumed["results"]["rank_state_runs_code"].values():
        assert result["error"] == "UnsafeCheckpointFile", result
        assert result["message"].startswith(f"{save_dir / 'step2' / RANK_STATE}: refusing to load a checkpoint file "
                                            "that holds io.open")
        assert "lazyzero.checkpoint.allow_pickle: true" in result["message"] and "weights_only" not in result["message"]
    assert not (save_dir.parent / "marker").exists()


def test_a_rank_state_file_in_torchs_legacy_format_loads(resumed):
    for result in resumed["results"]["rank_state_legacy_format"].values():
        assert (result["error"], result["tag"], result["step"]) == (None, "step2", 2), result


# --- lazyzero train --resume, 2 ranks ------------------------------------------------------------------

@pytest.fixture
def damaged_latest_manifest(tmp_path, lazy_checkpoint_dir) -> Path:
    save_dir = shutil.copytree(lazy_checkpoint_dir, tmp_path / "save")
    _flip_bit(save_dir / "step4" / MANIFEST_NAME)
    return save_dir


def test_train_resume_stops_at_a_damaged_manifest_of_latest(damaged_latest_manifest, tmp_path, lazy_train):
    proc = lazy_train(tmp_path / "resumed", damaged_latest_manifest, "--resume", "--max-steps", "5")
    assert proc.returncode != 0
    manifest = damaged_latest_manifest / "step4" / MANIFEST_NAME
    assert f"the newest checkpoint, 'step4', is damaged: {manifest}: damaged; expected " in proc.stdout, \
        proc.stdout[-4000:]
    assert "lazyzero.checkpoint.on_damaged_latest: fall_back" in proc.stdout
    assert not (tmp_path / "resumed" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_train_resume_with_fall_back_says_so_and_continues_step2_exactly(damaged_latest_manifest, tmp_path, lazy_train,
                                                                         lazy_run_metrics, read_run_metrics):
    config = json.loads(LAZY_CONFIG.read_text())
    config["lazyzero"]["checkpoint"]["on_damaged_latest"] = "fall_back"
    (tmp_path / "fall_back.json").write_text(json.dumps(config))
    proc = lazy_train(tmp_path / "resumed", damaged_latest_manifest, "--resume", "--max-steps", "3",
                      "--deepspeed_config", str(tmp_path / "fall_back.json"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    manifest = damaged_latest_manifest / "step4" / MANIFEST_NAME
    assert f"the newest checkpoint, 'step4', is DAMAGED: {manifest}: damaged; expected " in proc.stdout
    assert "loading the older checkpoint 'step2' instead" in proc.stdout
    resumed = [(record["step"], record["loss"]) for record in read_run_metrics(tmp_path / "resumed")]
    assert resumed == [(3, lazy_run_metrics[2]["loss"])]


# --- lazyzero ckpt export --fp32 of files in torch's legacy format ---------------------------------------

def _resave_legacy(save_dir: Path, tag: str, suffix: str) -> list[Path]:
    """Every file of `tag` ending with `suffix` saved again in torch's legacy format, manifest updated."""
    manifest = read_manifest(save_dir / tag)
    paths = []
    for relpath in [r for r in manifest.files if r.endswith(suffix)]:
        path = save_dir / tag / relpath
        torch.save(load_checkpoint_file(path, "cpu"), path, _use_new_zipfile_serialization=False)
        manifest.files[relpath].update(size=path.stat().st_size, hash=hash_file(path)[1])
        paths.append(path)
    manifest.write(save_dir / tag)
    return paths


def test_fp32_export_reads_legacy_model_files_and_names_legacy_optimizer_files(lazy_checkpoint_dir, tmp_path,
                                                                                      capsys):
    save_dir = shutil.copytree(lazy_checkpoint_dir, tmp_path / "save")
    intact = tmp_path / "intact.pt"
    assert main(["ckpt", "export", str(save_dir), "step2", "--out", str(tmp_path / "a"), "--fp32", str(intact)]) == 0

    assert _resave_legacy(save_dir, "step2", "model_states.pt")
    legacy = tmp_path / "legacy.pt"
    assert main(["ckpt", "export", str(save_dir), "step2", "--out", str(tmp_path / "b"), "--fp32", str(legacy)]) == 0
    expected, found = torch.load(intact), torch.load(legacy)
    assert expected.keys() == found.keys()
    for name, value in expected.items():
        torch.testing.assert_close(found[name], value, **EXACT)

    optimizer_file = _resave_legacy(save_dir, "step2", "optim_states.pt")[0]
    refused = tmp_path / "refused.pt"
    status = main(["ckpt", "export", str(save_dir), "step2", "--out", str(tmp_path / "c"), "--fp32", str(refused)])
    err = capsys.readouterr().err
    assert status == 1 and f"not exporting step2: {optimizer_file}: in torch's legacy (non-zip) format" in err
    assert not refused.exists()
