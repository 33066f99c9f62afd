"""The `lazyzero` command line: config check, config reference, ops status, env."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _lazyzero(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lazyzero.cli", *args], capture_output=True, text=True,
                          timeout=180, cwd=cwd)


def test_config_check_accepts_the_shipped_demo_config():
    proc = _lazyzero("config", "check", str(ROOT / "ds_configs" / "cpu_demo.json"))
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout and "features on: none" in proc.stdout


def test_config_check_reports_every_problem_with_key_path_and_allowed_values(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                               "lazyzero": {"gradients": {"block_size": 100}, "optimizer": {"tpye": "adam8bit"}}}))
    proc = _lazyzero("config", "check", str(bad), cwd=tmp_path)
    assert proc.returncode == 2
    assert "lazyzero.gradients.block_size: got 100; allowed: a power of two" in proc.stderr
    assert "lazyzero.optimizer.tpye: unknown key" in proc.stderr and "did you mean 'type'" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_config_check_names_a_file_that_is_not_json(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text('{"lazyzero": {}')
    proc = _lazyzero("config", "check", str(bad))
    assert proc.returncode == 2 and "broken.json" in proc.stderr


def test_config_check_names_the_keys_a_trainer_fills_in_instead_of_failing_on_them():
    proc = _lazyzero("config", "check", str(ROOT / "ds_configs" / "cpu_hf_trainer.json"))
    assert proc.returncode == 0, proc.stderr
    assert "OK" in proc.stdout and "features on: gradients, optimizer, checkpoint" in proc.stdout
    assert ("not checked, \"auto\" (the Hugging Face Trainer or Accelerate fills them in before "
            "deepspeed.initialize): train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, "
            "gradient_clipping, optimizer.params.lr, optimizer.params.weight_decay") in proc.stdout


def test_config_check_still_runs_deepspeeds_parse_on_the_keys_it_can_check(tmp_path):
    config = tmp_path / "auto.json"
    config.write_text(json.dumps({"train_batch_size": "auto", "bf16": {"enabled": "auto"},
                                  "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "bogus": 1},
                                  "lazyzero": {"optimizer": {"enabled": "auto"}}}))
    proc = _lazyzero("config", "check", str(config))
    assert proc.returncode == 2
    # "auto" inside the "lazyzero" section is not a trainer's: it stays an error.
    assert "lazyzero.optimizer.enabled: got 'auto'" in proc.stderr
    assert "DeepSpeed's own parse failed" in proc.stderr and "bogus" in proc.stderr


def test_ops_status_names_both_backends():
    proc = _lazyzero("ops", "status")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("cpu") for line in lines) and any(line.startswith("cuda") for line in lines)


def test_env_reports_versions_ops_internals_nvme_mpi_and_accelerators():
    from importlib.metadata import version

    import deepspeed

    proc = _lazyzero("env", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert list(report) == ["versions", "native ops", "DeepSpeed internals", "NVMe offload", "MPI", "accelerators",
                            "background priority", "platform"]
    # The installed distributions' versions: PyPI's CUDA wheel is "2.14.1" there and "2.14.1+cu130" in
    # torch.__version__.
    assert f"torch: {version('torch')}" in report["versions"]
    assert f"deepspeed: {version('deepspeed')}" in report["versions"]
    assert report["native ops"][0].startswith("cpu ") and report["native ops"][1].startswith("cuda ")
    assert report["DeepSpeed internals"][0].startswith("DeepSpeed internals: OK (all ")
    assert report["DeepSpeed internals"][-1].startswith(f"DeepSpeed {deepspeed.__version__}: inside the tested range ")
    assert any(line.startswith("DeepSpeed async_io op: ") for line in report["NVMe offload"])
    assert any(line.startswith("DeepSpeed accelerator: ") for line in report["accelerators"])
    cpu_line, io_line = report["background priority"]
    assert cpu_line.startswith("idle CPU priority for checkpoint threads (SCHED_IDLE): ")
    assert io_line.startswith("idle I/O priority for checkpoint threads (IOPRIO_CLASS_IDLE): ")


def test_env_survives_a_probe_that_fails(monkeypatch):
    from lazyzero.app import environment

    def broken():
        raise OSError("no such library")

    monkeypatch.setitem(environment.SECTIONS, "MPI", broken)
    report = environment.environment_report()
    assert report["MPI"] == ["probe failed: OSError: no such library"]
    assert "## MPI\n  probe failed" in environment.format_report(report)


def test_help_loads_no_heavy_library():
    """`lazyzero --help` answers at once: building the parser imports neither torch, DeepSpeed,
    transformers nor the MILP solver (names resolved on first use: lazyzero.models, lazyzero.plan)."""
    probe = ("import sys\nfrom lazyzero.cli import build_parser\nbuild_parser().format_help()\n"
             "print(sorted(m for m in ('torch', 'deepspeed', 'transformers', 'mip') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
    help_text = _lazyzero("--help")
    assert help_text.returncode == 0 and "ckpt" in help_text.stdout
