"""docs/reliability.md guarantee 5: a rank that is killed, exits or is stopped ends the job (2 real ranks).

Each case launches tests/distributed/dead_rank_worker.py (ZeRO-2, lazy checkpoints, step2 committed,
step4 saved in the background) under the deepspeed launcher or mpirun with a short
`lazyzero.distributed.timeout_s`, and hurts one rank: before a training step's gradient collective
(the worker's FAULT argument), or inside the step-4 checkpoint (LAZYZERO_FAILPOINT with
LAZYZERO_FAILPOINT_SIGNAL: `mid_file` in the snapshot's writes, `before_manifest` in the flush
thread's agreement). Then:
- the launcher ends non-zero, and no rank finished;
- a surviving rank that left by an error did so after waiting at most the timeout (plus a margin)
  in the call that failed, with gloo's error; a rank the launcher ended has no error record;
- every rank's process is gone once the launcher returns (no orphan, stopped or not);
- `latest` still names step2, the only committed checkpoint.
The deepspeed launcher ends a stopped rank only 30 s after another failed (its SIGTERM waits until
SIGKILL), so its stopped cases take timeout + 30 s + start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lazyzero.checkpoint.folder_layout import read_latest
from lazyzero.checkpoint.manifest import list_checkpoints
from lazyzero.distributed.job_failure import PEER_LOST_MESSAGES
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "dead_rank_worker.py"
# Measured here: a rank raises 10.0 s into a 10 s timeout; the margin covers a loaded machine.
MARGIN_S = 10.0
# Start (two ranks importing torch and DeepSpeed, ~10 s here), the timeout, the deepspeed launcher's
# 30 s grace for a stopped rank, and room.
LAUNCH_LIMIT_S = 150


@dataclass(frozen=True)
class Case:
    launcher: str
    where: str  # "step", or the checkpoint failpoint
    how: str  # SIGKILL, SIGSTOP, exit
    victim: int
    timeout_s: float = 10.0

    @property
    def name(self) -> str:
        return f"{self.launcher}-{self.where}-{self.how}@{self.victim}-t{self.timeout_s:g}"

    def argv(self, out: Path) -> list[str]:
        fault = [f"{self.victim}:{self.how}:4"] if self.where == "step" else []
        return [str(WORKER), str(out), str(self.timeout_s), *fault]

    def env(self) -> dict:
        if self.where == "step":
            return {}
        return {"LAZYZERO_FAILPOINT": f"{self.where}@{self.victim}#2", "LAZYZERO_FAILPOINT_SIGNAL": self.how}


# One short case in the default suite: a stopped rank under mpirun, where the error must also
# abort the MPI job (MPI_Finalize would wait for the stopped rank forever).
DEFAULT_CASES = [Case("mpirun", "step", "SIGSTOP", 1, timeout_s=3.0)]
SLOW_CASES = [
    Case("deepspeed", "step", "SIGSTOP", 1),
    Case("deepspeed", "step", "SIGKILL", 0),
    Case("deepspeed", "step", "exit", 1),
    Case("deepspeed", "mid_file", "SIGSTOP", 0),
    Case("deepspeed", "mid_file", "SIGKILL", 1),
    Case("deepspeed", "before_manifest", "SIGSTOP", 1),
    Case("mpirun", "step", "SIGSTOP", 0),
    Case("mpirun", "step", "SIGKILL", 1),
    Case("mpirun", "step", "exit", 0),
    Case("mpirun", "mid_file", "SIGSTOP", 1),
    Case("mpirun", "before_manifest", "SIGKILL", 0),
]
PARAMS = ([pytest.param(case, id=case.name) for case in DEFAULT_CASES]
          + [pytest.param(case, id=case.name, marks=pytest.mark.slow) for case in SLOW_CASES])


def alive(pid: int) -> bool:
    """A process that still runs or is stopped (a zombie has ended: it only awaits its reaping)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.multiproc
@pytest.mark.parametrize("case", PARAMS)
def test_a_dead_or_stopped_rank_ends_the_job_within_the_timeout(tmp_path, case):
    started = time.monotonic()
    proc = run_distributed(case.launcher, 2, case.argv(tmp_path), timeout=LAUNCH_LIMIT_S, env=case.env())
    launch_s = time.monotonic() - started
    output = proc.stdout[-6000:]
    assert proc.returncode != 0, output
    assert not list(tmp_path.glob("done_rank*.json")), output
    pids = [int(p.read_text().split()[0]) for p in sorted(tmp_path.glob("pid_rank*"))]
    assert len(pids) == 2, output
    assert [pid for pid in pids if alive(pid)] == [], output
    survivors = [json.loads(p.read_text()) for p in tmp_path.glob("error_rank*.json")]
    for error in survivors:
        if error["rank"] == case.victim:
            continue  # a stopped victim the launcher woke and ended
        assert error["waited_s"] <= case.timeout_s + MARGIN_S, (error, output)
        assert any(text in error["message"] for text in PEER_LOST_MESSAGES), error
    if case.how == "SIGSTOP" and case.launcher == "mpirun":
        # nothing else ends a stopped rank's peer: it must have raised after the timeout, and said why
        survivor = next(e for e in survivors if e["rank"] != case.victim)
        assert survivor["waited_s"] >= case.timeout_s - 1, survivor
        assert "lazyzero.distributed.timeout_s" in output
    save_dir = tmp_path / "ckpt"
    assert read_latest(save_dir) == "step2"
    assert [(entry.tag, entry.problem) for entry in list_checkpoints(save_dir)] == [("step2", "")]
    print(f"{case.name}: launcher returned {proc.returncode} after {launch_s:.1f} s; "
          f"errors: {[(e['rank'], e['call'], round(e['waited_s'], 1)) for e in survivors]}")


def test_an_uncaught_lost_peer_error_names_the_timeout_and_ends_the_process_non_zero():
    script = ("from datetime import timedelta\n"
              "from lazyzero.distributed.job_failure import end_job_on_uncaught_error\n"
              "end_job_on_uncaught_error(timedelta(seconds=7))\n"
              "raise RuntimeError('Timed out waiting 7000ms for recv operation to complete')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "RuntimeError: Timed out waiting 7000ms" in proc.stderr
    assert "lazyzero.distributed.timeout_s = 7 s" in proc.stderr
