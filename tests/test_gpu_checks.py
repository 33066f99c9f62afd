"""benchmarks/gpu_checks.sh cannot rot between GPU sessions: its dry run (every step's command built,
the script's flags and the inputs checked, nothing timed) passes here, its steps keep their order and
fit the 9-minute budget by their limits, and its summary (benchmarks/gpu_summary.py) leaves out, with
the reason, every key a step could not give."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_summary  # noqa: E402

STEPS_IN_ORDER = ["build", "kernel_tests", "planner_1b", "packing_1b", "checkpoint_stall", "optimizer"]
BUDGET_S = 540


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_checks")
    env = {**os.environ, "GPU_CHECKS_DRY_RUN": "1", "OUT": str(out)}
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc, out


def test_the_dry_run_builds_and_checks_every_step(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "status 0" in proc.stdout
    steps = re.findall(r"^\[gpu_checks\] (\w+) \(limit (\d+) s", proc.stdout, flags=re.M)
    assert [name for name, _ in steps] == STEPS_IN_ORDER
    # The NCCL step has no GPU here (nor more than one on the lent machines): its JSON says why.
    assert "more than one GPU" in json.loads((out / "int8_exchange_nccl.json").read_text())["skipped"]
    # Every timed step writes its JSON into $OUT.
    for name in STEPS_IN_ORDER[2:]:
        assert f"--out {out}/{name}.json" in proc.stdout


def test_the_steps_fit_nine_minutes_by_their_limits(dry_run):
    proc, _ = dry_run
    limits = [int(limit) for _, limit in re.findall(r"^\[gpu_checks\] (\w+) \(limit (\d+) s", proc.stdout, flags=re.M)]
    summary_limit = int(re.search(r"timeout (\d+) python3 benchmarks/gpu_summary.py", SCRIPT.read_text()).group(1))
    assert sum(limits) + summary_limit <= BUDGET_S
    assert re.search(rf"BUDGET_S=\$\{{GPU_CHECKS_BUDGET_S:-{BUDGET_S}\}}", SCRIPT.read_text())


def write(folder: Path, name: str, document: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(document))


def test_the_summary_takes_each_key_from_its_step(tmp_path):
    write(tmp_path, "planner_1b", {"speedup_vs_deepspeed_default": 1.8, "pred_error_step_time": 0.07,
                                   "model_flops_fraction": 0.05})
    write(tmp_path, "packing_1b", {"step_time_ratio": 1.1})
    write(tmp_path, "checkpoint_stall", {"stall_ratio_vs_deepspeed": 12.0})
    write(tmp_path, "optimizer", {"gpu_bandwidth_fraction": 0.7, "gpu_speed_ratio_vs_torch_adamw_fused": 1.4})
    summary = gpu_summary.summarize(tmp_path, {}, "NVIDIA H100 80GB HBM3")
    assert {key: summary[key] for key in gpu_summary.KEYS} == {
        "packing_step_time_ratio_1b": 1.1, "planner_speedup_vs_zero_infinity_1b": 1.8,
        "planner_pred_error_step_time_1b": 0.07, "planner_model_flops_fraction_1b": 0.05,
        "checkpoint_stall_ratio_vs_deepspeed": 12.0, "optimizer_bandwidth_fraction": 0.7,
        "optimizer_speed_ratio_vs_torch_fused": 1.4}
    assert summary["missing"] == {} and summary["gpu"] == "NVIDIA H100 80GB HBM3"


def test_a_step_that_could_not_run_leaves_its_keys_out_and_says_why(tmp_path):
    # The planner stopped in its baseline run: the plan's figures were written, the speedup was not; the
    # GPU's peak was unknown. The checkpoint step hit its limit before writing; packing was never started.
    write(tmp_path, "planner_1b", {"pred_error_step_time": 0.07,
                                   "gpu": {"skipped": {"model_flops_fraction": "no dense bf16 peak known for 'X'"}}})
    write(tmp_path, "packing_1b", {"step": "packing_1b", "skipped": "not started: 500 s gone"})
    write(tmp_path, "optimizer", {"gpu_bandwidth_fraction": 0.7, "gpu_speed_ratio_vs_torch_adamw_fused": 1.4})
    (tmp_path / "steps.tsv").write_text("planner_1b\t134\t210\t210\t\ncheckpoint_stall\t134\t90\t90\t\n"
                                        "packing_1b\tskipped\t0\t0\tnot started: 500 s gone\n")
    steps = gpu_summary.read_steps(tmp_path / "steps.tsv")
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_summary.py"), "--out-dir", str(tmp_path),
                    "--steps", str(tmp_path / "steps.tsv")], check=True, capture_output=True, timeout=60)
    summary = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert summary["planner_pred_error_step_time_1b"] == 0.07 and summary["optimizer_bandwidth_fraction"] == 0.7
    missing = summary["missing"]
    assert set(missing) == {"planner_speedup_vs_zero_infinity_1b", "planner_model_flops_fraction_1b",
                            "checkpoint_stall_ratio_vs_deepspeed", "packing_step_time_ratio_1b"}
    assert not set(missing) & set(summary)
    assert "stopped at its 210 s limit" in missing["planner_speedup_vs_zero_infinity_1b"]
    assert "no dense bf16 peak" in missing["planner_model_flops_fraction_1b"]
    assert missing["checkpoint_stall_ratio_vs_deepspeed"] == \
        "no checkpoint_stall.json: step checkpoint_stall stopped at its 90 s limit (exit 134)"
    assert "not started" in missing["packing_step_time_ratio_1b"]
    assert summary["steps"] == steps
