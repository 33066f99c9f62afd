"""The end of a job loses nothing (docs/checkpoint.md, "The end of a job"; docs/reliability.md,
guarantee 8): a plain script whose last line is a lazy save, or that ends in any of the ways real
scripts end, leaves that checkpoint committed and every rank exits cleanly; a commit that fails at
exit is named and makes the exit status non-zero; SIGTERM stops every rank after the same step,
saves and commits, and the resume continues bit for bit. Real processes on 2 ranks."""

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lazyzero.checkpoint.folder_layout import TEMP_PREFIX, read_latest
from lazyzero.checkpoint.manifest import committed_tags
from lazyzero.distributed.launch import distributed_env, free_port, launch_command
from lazyzero.testing import run_distributed

WORKER = str(Path(__file__).resolve().parent / "job_end_worker.py")
pytestmark = pytest.mark.multiproc


def run_job(tmp_path: Path, steps: int, save_every: int, end: str = "exit", *flags: str, env: dict | None = None,
            launcher: str = "deepspeed") -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return run_distributed(launcher, 2, [WORKER, str(tmp_path), str(tmp_path / "ckpt"), str(steps), str(save_every),
                                         end, *flags], timeout=300, env=env)


def losses(out: Path, rank: int = 0) -> dict[int, float]:
    lines = (out / f"losses_rank{rank}.jsonl").read_text().splitlines()
    return {entry["step"]: entry["loss"] for entry in map(json.loads, lines)}


def assert_same_losses(found: dict[int, float], whole: dict[int, float], resumed_after: int) -> None:
    """Every recorded loss equals the uninterrupted run's bit for bit, and every step after the
    checkpoint resumed from was recorded."""
    assert found == {step: whole[step] for step in found}
    assert set(range(resumed_after + 1, max(whole) + 1)) <= set(found)


def assert_only_committed(save_dir: Path, newest: str) -> None:
    assert read_latest(save_dir) == newest
    assert newest in committed_tags(save_dir)
    assert not [p.name for p in save_dir.iterdir() if p.name.startswith(TEMP_PREFIX)]


@pytest.mark.parametrize("end", ["exit", "raise", pytest.param("destroy_process_group", marks=pytest.mark.slow)])
def test_the_last_lazy_save_commits_however_the_script_ends(tmp_path, end):
    proc = run_job(tmp_path, 4, 2, end)
    assert proc.returncode == (1 if end == "raise" else 0), proc.stdout[-4000:]
    assert_only_committed(tmp_path / "ckpt", "global_step4")
    assert "terminate called" not in proc.stdout and "Fatal Python error" not in proc.stdout, proc.stdout[-4000:]


def test_a_commit_that_fails_at_exit_names_the_checkpoint_and_the_exit_status_is_nonzero(tmp_path):
    # Rank 1's first fsync fails (disk full) while the script's only checkpoint is written after its last line.
    proc = run_job(tmp_path, 2, 2, "exit", env={"LAZYZERO_IO_FAULT": "fsync:1@1"})
    assert proc.returncode != 0
    assert "checkpoint 'global_step2' was not committed" in proc.stdout and "No space left" in proc.stdout, \
        proc.stdout[-4000:]
    assert read_latest(tmp_path / "ckpt") is None


def test_sigterm_on_one_rank_stops_every_rank_after_one_step_saves_and_resumes_bit_exact(tmp_path):
    whole = tmp_path / "whole"
    assert run_job(whole, 7, 2).returncode == 0
    stopped = tmp_path / "stopped"
    proc = run_job(stopped, 7, 2, "exit", "save_on_sigterm", env={"JOB_END_SIGTERM_AT": "3@1"})
    assert proc.returncode == 143, proc.stdout[-4000:]
    # Rank 1 received it after step 3; both agreed at step 4 and saved there.
    assert "stopped by SIGTERM after step 4; saved and committed global_step4" in proc.stdout
    assert_only_committed(stopped / "ckpt", "global_step4")
    assert run_job(stopped, 7, 2, "exit", "resume").returncode == 0
    for rank in (0, 1):
        # Step 4's loss is not recorded: the stop ends the script inside that step's engine.step().
        assert_same_losses(losses(stopped, rank), losses(whole, rank), resumed_after=4)


@pytest.mark.slow
def test_sigterm_without_save_on_sigterm_commits_the_checkpoint_in_flight_and_names_it(tmp_path):
    proc = run_job(tmp_path, 7, 2, "exit", env={"JOB_END_SIGTERM_AT": "2@0"})
    assert proc.returncode == 143, proc.stdout[-4000:]
    # Saved after step 2, in flight when rank 0 received the signal; every rank stopped after step 3.
    assert "stopped by SIGTERM after step 3; the newest committed checkpoint is global_step2" in proc.stdout
    assert_only_committed(tmp_path / "ckpt", "global_step2")
    assert max(losses(tmp_path)) == 2  # step 3's loss is known only once its step returned


# --- SIGTERM from outside, as a cluster sends it -----------------------------------------------------

RUNS = 10
STEPS = 12


def sigterm_job_at_random(out: Path, launcher: str, seed: int) -> subprocess.CompletedProcess:
    """Start the job and SIGTERM it once a random number of steps has run, as a cluster does: under
    the deepspeed launcher the launcher's whole process group (SLURM signals every process of a job
    step); under mpirun the ranks, since mpirun SIGKILLs them about a second after a SIGTERM of its
    own (Open MPI 5 has no setting for that delay; docs/checkpoint.md, "SIGTERM and preemption")."""
    out.mkdir(parents=True)
    argv = [WORKER, str(out), str(out / "ckpt"), str(STEPS), "2", "exit", "save_on_sigterm"]
    process = subprocess.Popen(launch_command(launcher, 2, argv, (), free_port()), env=distributed_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    after = random.Random(seed).randint(1, STEPS - 4)
    record = out / "losses_rank0.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if record.exists() and len(record.read_text().splitlines()) >= after:
            break
        time.sleep(0.05)
    if launcher == "mpirun":
        for rank in (0, 1):
            os.kill(int((out / f"pid_rank{rank}").read_text()), signal.SIGTERM)
    else:
        os.killpg(process.pid, signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    (out / "launcher.log").write_text(output)
    return subprocess.CompletedProcess(argv, process.returncode, output)


STOPPED = re.compile(r"stopped by SIGTERM after step (\d+); saved and committed global_step(\d+)")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "mpirun"])
def test_sigterm_at_random_moments_of_ten_runs_resumes_bit_exact(tmp_path, launcher):
    if launcher == "mpirun":
        pytest.importorskip("mpi4py")
    whole = tmp_path / "whole"
    assert run_job(whole, STEPS, 2, launcher=launcher).returncode == 0
    for seed in range(RUNS):
        out = tmp_path / f"run{seed}"
        proc = sigterm_job_at_random(out, launcher, seed)
        stopped = STOPPED.search(proc.stdout)
        assert proc.returncode != 0 and stopped and stopped.group(1) == stopped.group(2), (seed, proc.stdout[-3000:])
        assert_only_committed(out / "ckpt", f"global_step{stopped.group(1)}")
        assert run_job(out, STEPS, 2, "exit", "resume", launcher=launcher).returncode == 0
        for rank in (0, 1):
            assert_same_losses(losses(out, rank), losses(whole, rank), int(stopped.group(1)))
