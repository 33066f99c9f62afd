"""docs/reliability.md row 1: SIGKILL at each failpoint of a lazy save, then a fresh run resumes (2 real ranks).

Each case trains 6 steps and saves step2, step4, step6 (tests/checkpoint/lazy_ckpt_worker.py, mode
train); LAZYZERO_FAILPOINT=NAME@RANK#N SIGKILLs RANK at the N-th checkpoint (step<2N>). Then the job
must have ended non-zero; `list_checkpoints` must show only committed checkpoints; one more launch
resumes every case with a fresh engine, which must remove the leftovers with a warning and load
exactly the reference state of the step it names:
  kill before the folder rename (after_snapshot .. after_manifest): the previous checkpoint;
  after_rename: the new tag is committed, but 'latest' still names the previous one, which loads;
  after_latest: the new one.
The default suite runs each failpoint once, over both ranks and ZeRO-2/3 (one launch per case is
~25 s here); the slow suite runs the whole matrix, which repeats those cases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from lazyzero.checkpoint.faults import FAILPOINTS
from lazyzero.checkpoint.folder_layout import leftover_dirs, read_latest, temp_dir
from lazyzero.checkpoint.manifest import list_checkpoints
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "lazy_ckpt_worker.py"
STEPS, SAVE_EVERY = 6, 2
RANK0_ONLY = {"after_manifest", "after_rename", "after_latest"}  # steps of the commit, which rank 0 does
BEFORE_RENAME = {"after_snapshot", "mid_file", "before_manifest", "after_manifest"}


@dataclass(frozen=True)
class Case:
    failpoint: str
    rank: int
    stage: int
    nth: int = 2  # the checkpoint killed: step<2 * nth>

    @property
    def name(self) -> str:
        return f"{self.failpoint}@{self.rank}#{self.nth}-zero{self.stage}"

    @property
    def killed_tag(self) -> str:
        return f"step{SAVE_EVERY * self.nth}"

    @property
    def earlier_tags(self) -> list[str]:
        return [f"step{SAVE_EVERY * n}" for n in range(1, self.nth)]

    @property
    def committed(self) -> list[str]:
        return self.earlier_tags + ([] if self.failpoint in BEFORE_RENAME else [self.killed_tag])

    @property
    def latest(self) -> str | None:
        return self.killed_tag if self.failpoint == "after_latest" else (self.earlier_tags or [None])[-1]


# The default suite kills one save before anything is committed (a torn file), one with every file
# written but no manifest, and one after the commit; every failpoint on both ranks and stages runs
# with -m slow (FULL_CASES).
DEFAULT_CASES = [Case("mid_file", 0, 2), Case("before_manifest", 1, 2), Case("after_latest", 0, 3)]
FULL_CASES = [Case(failpoint, rank, stage) for stage in (2, 3) for failpoint in FAILPOINTS
              for rank in ((0,) if failpoint in RANK0_ONLY else (0, 1))]
# A kill in the first checkpoint: nothing to resume from; the leftover is still cleaned.
FULL_CASES += [Case("mid_file", 0, 2, nth=1), Case("mid_file", 1, 3, nth=1)]


def crash_and_resume(root: Path, cases: list[Case]) -> dict[Case, dict]:
    """One killed training launch per case, then one launch resuming every case."""
    outcomes = {}
    for case in cases:
        folder = root / case.name
        save_dir = folder / "ckpt"
        proc = run_distributed("deepspeed", 2, [str(WORKER), "train", str(folder), str(save_dir), str(case.stage),
                                                str(STEPS), str(SAVE_EVERY)],
                               timeout=300, env={"LAZYZERO_FAILPOINT": f"{case.failpoint}@{case.rank}#{case.nth}"})
        listed = list_checkpoints(save_dir) if save_dir.is_dir() else []
        outcomes[case] = {"returncode": proc.returncode, "output": proc.stdout[-4000:],
                          "finished": sorted(p.name for p in folder.glob("train_rank*.json")),
                          "listed": [(entry.tag, entry.problem) for entry in listed],
                          "latest": read_latest(save_dir), "leftovers": leftover_dirs(save_dir), "save_dir": save_dir}
    resumed = [f"{case.stage}:{root / case.name / 'ckpt'}:{root / case.name / 'ref'}" for case in cases]
    proc = run_distributed("deepspeed", 2, [str(WORKER), "load", str(root), *resumed], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    loads = [json.loads((root / f"load_rank{rank}.json").read_text()) for rank in (0, 1)]
    for case, outcome in outcomes.items():
        outcome.update(resume_output=proc.stdout, leftovers_after_resume=leftover_dirs(outcome["save_dir"]),
                       loaded=[load[str(outcome["save_dir"])] for load in loads])
    return outcomes


@pytest.fixture(scope="module")
def default_outcomes(tmp_path_factory):
    return crash_and_resume(tmp_path_factory.mktemp("crash_default"), DEFAULT_CASES)


@pytest.fixture(scope="module")
def full_outcomes(tmp_path_factory):
    return crash_and_resume(tmp_path_factory.mktemp("crash_full"), FULL_CASES)


def params(suite: str, cases: list[Case], marks: tuple = ()) -> list:
    return [pytest.param(suite, case, id=f"{suite}-{case.name}", marks=marks) for case in cases]


PARAMS = params("default", DEFAULT_CASES) + params("full", FULL_CASES, marks=(pytest.mark.slow,))


@pytest.mark.multiproc
@pytest.mark.parametrize("suite,case", PARAMS)
def test_sigkill_during_a_save_leaves_the_previous_or_the_new_checkpoint(request, suite, case):
    outcome = request.getfixturevalue(f"{suite}_outcomes")[case]
    assert outcome["returncode"] != 0 and not outcome["finished"], outcome["output"]
    # Temporary folders are never listed; whatever is listed is committed (has a readable manifest).
    assert outcome["listed"] == [(tag, "") for tag in case.committed], outcome["output"]
    assert outcome["latest"] == case.latest
    if case.failpoint in BEFORE_RENAME:
        assert temp_dir(outcome["save_dir"], case.killed_tag) in outcome["leftovers"]
    for leftover in outcome["leftovers"]:
        assert f"removing {leftover}" in outcome["resume_output"]
    assert outcome["leftovers_after_resume"] == []
    for rank, loaded in enumerate(outcome["loaded"]):
        assert loaded["tag"] == case.latest, f"rank {rank}: {loaded}"
        if case.latest is not None:
            assert loaded["step"] == int(case.latest.removeprefix("step"))
            assert loaded["compared"] > 0
            assert loaded["differences"] == [], f"rank {rank}"
