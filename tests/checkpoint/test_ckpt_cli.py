"""`lazyzero ckpt ls | verify | export`: output, exit codes, and that plain DeepSpeed loads both a
lazyzero checkpoint folder and its export (tests/checkpoint/ckpt_plain_ds_worker.py)."""

import datetime
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from lazyzero.checkpoint.folder_layout import MANIFEST_NAME, temp_dir, trash_dir
from lazyzero.cli import main
from lazyzero.testing import EXACT, run_distributed

ROOT = Path(__file__).resolve().parents[2]
LAZY_CONFIG = ROOT / "ds_configs" / "cpu_demo_lazy_ckpt.json"
WORKER = ROOT / "tests" / "checkpoint" / "ckpt_plain_ds_worker.py"
DS_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
HANDMADE = {DS_FILE: b"deepspeed bytes " * 64, "lazyzero_rank00000.pt": b"lazyzero bytes " * 8}


def _ckpt(capsys, *argv) -> tuple[int, str, str]:
    status = main(["ckpt", *map(str, argv)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def handmade(tmp_path, make_checkpoint) -> Path:
    """t1 (step 1) and t2 (step 2) committed, 'latest' = t1."""
    save_dir = tmp_path / "save"
    make_checkpoint(save_dir, "t1", HANDMADE, created_unix=1_700_000_000.0, global_steps=1)
    make_checkpoint(save_dir, "t2", HANDMADE, created_unix=1_700_000_100.0, global_steps=2)
    (save_dir / "latest").write_text("t1")
    return save_dir


def test_ls_lists_tags_uncommitted_folders_and_leftovers(handmade, capsys):
    (handmade / "half").mkdir()
    (handmade / "half" / DS_FILE).write_bytes(b"x" * 2048)
    temp_dir(handmade, "t3").mkdir()
    trash_dir(handmade, "t0").mkdir()
    (handmade / "t2" / DS_FILE).write_bytes(b"short")

    status, out, _ = _ckpt(capsys, "ls", handmade)
    assert status == 0
    header, t1, t2, half, *rest = out.splitlines()
    assert header.split() == ["TAG", "STEP", "SIZE", "FILES", "COMMITTED", "STATUS"]
    committed_at = datetime.datetime.fromtimestamp(1_700_000_000.0).isoformat(timespec="seconds")
    assert t1.split() == ["t1", "1", "1.1", "KiB", "2", committed_at, "committed", "<-", "latest"]
    assert "committed, DAMAGED: 1 problem(s); see `lazyzero ckpt verify`" in t2
    assert half.split()[:5] == ["half", "-", "2.0", "KiB", "1"]
    assert "NOT COMMITTED: lazyzero_manifest.json: missing" in half
    assert rest == [".lazyzero-tmp.t3/: leftover, removed at next start",
                    ".lazyzero-trash.t0/: leftover, removed at next start"]


def test_ls_warns_when_latest_names_a_missing_tag(handmade, capsys):
    (handmade / "latest").write_text("t7")
    status, out, _ = _ckpt(capsys, "ls", handmade)
    assert status == 0 and "<- latest" not in out
    assert out.splitlines()[-1] == (f"warning: {handmade}: 'latest' names 't7', which is missing or was never "
                                    "committed; loading the newest committed checkpoint 't2' instead")


@pytest.mark.parametrize("argv", [["ls"], ["verify"], ["export", "--out", "OUT"]])
def test_every_command_refuses_a_missing_folder_or_a_file(tmp_path, capsys, argv):
    argv = [str(tmp_path / "exported") if a == "OUT" else a for a in argv]
    assert _ckpt(capsys, *argv[:1], tmp_path / "nothing", *argv[1:])[::2] == (
        2, f"lazyzero ckpt {argv[0]}: {tmp_path / 'nothing'}: no such folder\n")
    (tmp_path / "file").write_text("")
    assert _ckpt(capsys, *argv[:1], tmp_path / "file", *argv[1:])[::2] == (
        2, f"lazyzero ckpt {argv[0]}: {tmp_path / 'file'}: not a folder\n")
    assert not (tmp_path / "exported").exists()


def test_verify_checks_the_tag_latest_names_or_all(handmade, capsys):
    status, out, _ = _ckpt(capsys, "verify", handmade)
    size = sum(map(len, HANDMADE.values()))
    assert status == 0 and out.startswith(f"t1: OK, 2 files, {size:,} bytes (1.1 KiB) verified in ")
    status, out, _ = _ckpt(capsys, "verify", handmade, "--all")
    assert status == 0 and [line.split(":")[0] for line in out.splitlines()] == ["t1", "t2"]


def test_verify_reports_each_problem_and_exits_1(handmade, capsys):
    (handmade / "t2" / DS_FILE).write_bytes(b"D" * len(HANDMADE[DS_FILE]))
    (handmade / "t2" / "extra.pt").write_bytes(b"?")
    status, out, _ = _ckpt(capsys, "verify", handmade, "t2")
    assert status == 1
    lines = out.splitlines()
    assert lines[0] == "t2: DAMAGED (2 problem(s)):"
    assert (lines[1].startswith(f"  {handmade / 't2' / DS_FILE}: expected xxh3_128 ")
            and "(contents changed)" in lines[1])
    assert f"  {handmade / 't2' / 'extra.pt'}: not in the manifest (foreign file)" in lines[2]
    status, out, _ = _ckpt(capsys, "verify", handmade, "--all")
    assert status == 1 and "t1: OK" in out and "t2: DAMAGED" in out


def test_verify_usage_errors_exit_2_naming_what_exists(handmade, capsys):
    assert _ckpt(capsys, "verify", handmade, "t9")[::2] == (
        2, f"lazyzero ckpt verify: no tag 't9' in {handmade}; tags there: t1, t2\n")
    assert _ckpt(capsys, "verify", handmade, "t1", "--all")[::2] == (
        2, "lazyzero ckpt verify: give a TAG ('t1') or --all, not both\n")
    empty = handmade.parent / "empty"
    empty.mkdir()
    assert _ckpt(capsys, "verify", empty)[::2] == (
        2, f"lazyzero ckpt verify: {empty}: no 'latest' file, and no committed lazyzero checkpoint was found\n")


def test_export_writes_deepspeed_files_latest_and_recovery_scripts(handmade, tmp_path, capsys):
    out = tmp_path / "exported"
    status, stdout, _ = _ckpt(capsys, "export", handmade, "t2", "--out", out)
    assert status == 0 and f"exported t2 to {out}: 1 file(s) hard-linked, 0 copied" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["latest", "t2", "zero_to_fp32.py", "zero_to_torch.py"]
    assert [p.name for p in (out / "t2").iterdir()] == [DS_FILE]
    assert (out / "t2" / DS_FILE).stat().st_ino == (handmade / "t2" / DS_FILE).stat().st_ino
    assert (out / "latest").read_text() == "t2"
    assert os.access(out / "zero_to_fp32.py", os.X_OK)


def test_export_copies_where_hard_links_are_impossible(handmade, tmp_path, capsys, monkeypatch):
    def cross_device(source, target, **_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr("lazyzero.checkpoint.commands.os.link", cross_device)
    out = tmp_path / "exported"
    status, stdout, _ = _ckpt(capsys, "export", handmade, "--out", out)
    assert status == 0 and "0 file(s) hard-linked, 1 copied" in stdout
    assert (out / "t1" / DS_FILE).read_bytes() == HANDMADE[DS_FILE]
    assert (out / "t1" / DS_FILE).stat().st_ino != (handmade / "t1" / DS_FILE).stat().st_ino


def test_export_refuses_before_writing_anything(handmade, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert _ckpt(capsys, "export", handmade, "--out", taken)[::2] == (
        2, f"lazyzero ckpt export: --out {taken}: exists and is not an empty folder; refusing to overwrite it\n")
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    inside = handmade / "exported"
    assert _ckpt(capsys, "export", handmade, "--out", inside)[::2] == (
        2, f"lazyzero ckpt export: --out {inside}: inside the checkpoint folder {handmade}; "
           "choose a folder outside it\n")
    existing = tmp_path / "model.pt"
    existing.write_bytes(b"old")
    assert _ckpt(capsys, "export", handmade, "--out", tmp_path / "new", "--fp32", existing)[::2] == (
        2, f"lazyzero ckpt export: --fp32 {existing}: exists; refusing to overwrite it\n")
    assert not inside.exists() and not (tmp_path / "new").exists() and existing.read_bytes() == b"old"


def test_export_refuses_a_damaged_checkpoint(handmade, tmp_path, capsys):
    (handmade / "t1" / DS_FILE).unlink()
    status, out, err = _ckpt(capsys, "export", handmade, "--out", tmp_path / "exported")
    assert status == 1 and f"{handmade / 't1' / DS_FILE}: missing" in out and "not exporting t1: it is damaged" in err
    assert not (tmp_path / "exported").exists()


@pytest.fixture(scope="module")
def plain_deepspeed_loads(tmp_path_factory, lazy_checkpoint_dir) -> dict:
    """One 2-rank plain DeepSpeed worker loading: the lazyzero folder at step2 and through its
    'latest' (step4), and the export of step2. Returns the worker's records by name and the paths."""
    work = tmp_path_factory.mktemp("plain_ds")
    save_dir = shutil.copytree(lazy_checkpoint_dir, work / "save")
    exported = work / "exported"
    assert main(["ckpt", "export", str(save_dir), "step2", "--out", str(exported)]) == 0
    sources = [f"direct={save_dir}@step2", f"direct_latest={save_dir}", f"exported={exported}"]
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(LAZY_CONFIG), str(work), *sources], timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = {name: torch.load(work / f"{name}.pt") for name in ("direct", "direct_latest", "exported")}
    return {"records": records, "save_dir": save_dir, "exported": exported}


@pytest.mark.multiproc
def test_plain_deepspeed_loads_the_lazyzero_folder_and_its_export_with_the_runs_parameters(plain_deepspeed_loads,
                                                                                          lazy_run_metrics):
    records = plain_deepspeed_loads["records"]
    direct, exported = records["direct"], records["exported"]
    assert (direct["step"], exported["step"], records["direct_latest"]["step"]) == (2, 2, 4)
    assert direct["params"].keys() == exported["params"].keys()
    for name, value in direct["params"].items():
        torch.testing.assert_close(exported["params"][name], value, **EXACT)
    # The loss the lazyzero run logged for step 3, recomputed from the loaded step-2 parameters.
    assert lazy_run_metrics[2]["step"] == 3
    assert direct["next_loss"] == exported["next_loss"] == lazy_run_metrics[2]["loss"]


@pytest.mark.multiproc
def test_the_export_holds_exactly_deepspeeds_files_as_hard_links(plain_deepspeed_loads):
    save_dir, exported = plain_deepspeed_loads["save_dir"], plain_deepspeed_loads["exported"]
    deepspeed_files = sorted(p.name for p in (save_dir / "step2").iterdir()
                             if p.name != MANIFEST_NAME and not p.name.startswith("lazyzero_rank"))
    assert sorted(p.name for p in (exported / "step2").iterdir()) == deepspeed_files
    for name in deepspeed_files:
        assert (exported / "step2" / name).stat().st_ino == (save_dir / "step2" / name).stat().st_ino


@pytest.mark.multiproc
def test_fp32_export_equals_the_parameters_plain_deepspeed_loads(plain_deepspeed_loads, tmp_path, capsys):
    fp32_file = tmp_path / "fp32" / "model.pt"
    status, out, _ = _ckpt(capsys, "export", plain_deepspeed_loads["save_dir"], "step2", "--out", tmp_path / "exported",
                           "--fp32", fp32_file)
    assert status == 0 and f"wrote the fp32 state dict of step2 to {fp32_file}" in out
    assert [p.name for p in fp32_file.parent.iterdir()] == ["model.pt"]
    state_dict = torch.load(fp32_file)
    params = plain_deepspeed_loads["records"]["direct"]["params"]
    assert state_dict.keys() == params.keys()
    for name, value in params.items():
        torch.testing.assert_close(state_dict[name], value, **EXACT)


@pytest.mark.multiproc
def test_verify_of_the_real_checkpoint_defaults_to_latest(lazy_checkpoint_dir, capsys):
    status, out, _ = _ckpt(capsys, "verify", lazy_checkpoint_dir)
    assert status == 0 and out.startswith("step4: OK, 6 files, ")
