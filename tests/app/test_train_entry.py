"""The training entry point under real launchers: deepspeed and mpirun, save and exact resume."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "ds_configs" / "cpu_demo.json"


def _train_argv(output_dir: Path, *extra: str) -> list[str]:
    return ["-m", "lazyzero.train", "--deepspeed_config", str(CONFIG), "--model", "tiny",
            "--train-examples", "200", "--eval-problems", "4", "--eval-max-new-tokens", "8",
            "--output-dir", str(output_dir), *extra]


def _losses(output_dir: Path) -> dict[int, float]:
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _deepspeed(argv: list[str]):
    # The deepspeed launcher takes a module with --module, then the module's arguments.
    return run_distributed("deepspeed", 2, ["--module", *argv[1:]], cwd=ROOT)


@pytest.mark.multiproc
def test_deepspeed_launcher_run_logs_reports_saves_and_resumes_exactly(tmp_path):
    full, saves = tmp_path / "full", tmp_path / "ckpt"
    proc = _deepspeed(_train_argv(full, "--max-steps", "6", "--save-every", "3", "--save-dir", str(saves)))
    assert proc.returncode == 0, proc.stdout[-4000:]

    records = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "tokens_per_s", "step_time_s", "peak_mem_bytes", "checkpoint_stall_s"):
        assert all(isinstance(r[key], float | int) for r in records), key
    assert records[2]["checkpoint_stall_s"] > 0 and records[1]["checkpoint_stall_s"] == 0
    report = json.loads((full / "report.json").read_text())
    assert report["world_size"] == 2 and report["zero_stage"] == 3 and report["steps"] == 6
    assert report["eval_accuracy_before"] is not None and report["eval_accuracy_after"] is not None
    assert (full / "report.png").stat().st_size > 10_000
    assert (saves / "latest").read_text().strip() == "step6"

    # Resume from the step-3 checkpoint: steps 4-6 must repeat the uninterrupted run bit for bit.
    resumed_saves = tmp_path / "resume_ckpt"
    shutil.copytree(saves / "step3", resumed_saves / "step3")
    (resumed_saves / "latest").write_text("step3")
    resumed = tmp_path / "resumed"
    proc = _deepspeed(_train_argv(resumed, "--max-steps", "6", "--save-dir", str(resumed_saves), "--resume"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    resumed_losses, full_losses = _losses(resumed), _losses(full)
    assert sorted(resumed_losses) == [4, 5, 6]
    assert all(resumed_losses[s] == full_losses[s] for s in (4, 5, 6)), (resumed_losses, full_losses)


@pytest.mark.multiproc
def test_a_deepspeed_monitor_in_the_config_gets_the_lazyzero_metrics_and_the_run_keeps_its_own_logs(tmp_path):
    config = json.loads((ROOT / "ds_configs" / "cpu_demo_int8.json").read_text())
    config["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"}
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    argv = [arg if arg != str(CONFIG) else str(tmp_path / "ds_config.json")
            for arg in _train_argv(tmp_path / "out", "--max-steps", "5", "--eval-problems", "0")]
    proc = _deepspeed(argv)
    assert proc.returncode == 0, proc.stdout[-4000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and all(r["grad_wire_bytes"] > 0 for r in records)
    assert (tmp_path / "out" / "report.png").stat().st_size > 10_000
    for key in ("grad_wire_bytes", "grad_fp32_wire_bytes", "grad_exchange_s", "grad_overflow"):
        rows = (tmp_path / "csv" / "run" / f"lazyzero_{key}.csv").read_text().splitlines()
        assert rows[0] == f"step,{key}" and [row.split(",")[0] for row in rows[1:]] == ["1", "2", "3", "4", "5"]


@pytest.mark.multiproc
def test_mpirun_with_a_hostfile_runs_the_entry_point(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    proc = run_distributed("mpirun", 2, _train_argv(tmp_path, "--max-steps", "3"), cwd=ROOT,
                           launcher_args=("--hostfile", str(hostfile), "-x", "MASTER_ADDR=127.0.0.1"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert sorted(_losses(tmp_path)) == [1, 2, 3]
    assert json.loads((tmp_path / "report.json").read_text())["world_size"] == 2


def test_bad_config_is_rejected_before_anything_is_created(tmp_path):
    import subprocess

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "lazyzero": {"gradeints": {}}}))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "lazyzero.train", "--deepspeed_config", str(bad),
                           "--output-dir", str(out), "--save-dir", str(tmp_path / "ck"), "--save-every", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "lazyzero.gradeints" in proc.stderr and "did you mean 'gradients'" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_malformed_data_file_is_named_before_anything_is_created(tmp_path):
    import subprocess

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "fine"}\n{"question": "no answer"}\n')
    proc = subprocess.run([sys.executable, "-m", "lazyzero.train", "--deepspeed_config", str(CONFIG),
                           "--model", "tiny", "--data", str(data), "--output-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{data}:2" in proc.stderr and "'question' and 'answer'" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.jsonl"]
