"""A refusal ends a rank with one line (lazyzero/distributed/refusal_line.py): the traceback's frames, then
`lazyzero: <type>: <message>` as the last line, a multi-line message joined into one. Here in one process
without torch.distributed; two ranks refusing the same way (one full line, one pointer) are checked on real
launches: tests/checkpoint/test_damage_and_leftovers.py and tests/app/test_trainers.py."""

import sys
from datetime import timedelta

import pytest

from lazyzero.checkpoint.manifest import CheckpointDamagedError
from lazyzero.distributed import job_failure, refusal_line
from lazyzero.distributed.refusal_line import one_line, print_refusal, register_refusals

DAMAGED = "checkpoint /s/step4 is damaged (2 problem(s)):\n  /s/step4/a.pt: missing\n  /s/step4/b.pt: 3 bytes"


def raised(error: BaseException):
    try:
        raise error
    except BaseException as caught:  # noqa: BLE001 - the test's own error
        return type(caught), caught, caught.__traceback__


def test_the_line_joins_a_list_into_one_line_and_names_the_type():
    assert one_line(CheckpointDamagedError(DAMAGED)) == (
        "lazyzero: CheckpointDamagedError: checkpoint /s/step4 is damaged (2 problem(s)): /s/step4/a.pt: missing; "
        "/s/step4/b.pt: 3 bytes")
    assert one_line(RuntimeError("lazyzero: disk full\nsecond")) == "lazyzero: RuntimeError: disk full; second"


def test_ranks_refusing_with_their_own_numbers_refuse_the_same_way():
    same = refusal_line._same_kind
    assert same("rank_0: 1,024 bytes needed, 12 free") == same("rank_1: 2,048 bytes needed, 9 free")
    assert same("a.pt: missing") != same("a.pt: expected 3 bytes")


def test_the_refusing_rank_prints_the_frames_then_the_line_last(capsys, monkeypatch):
    monkeypatch.delenv(refusal_line.TRACEBACK_ENV, raising=False)
    _, error, frames = raised(CheckpointDamagedError(DAMAGED))
    print_refusal(error, frames)
    printed = capsys.readouterr().err.splitlines()
    assert printed[0] == "Traceback (most recent call last):" and "in raised" in "\n".join(printed)
    assert printed[-1] == one_line(error) and sum(DAMAGED.splitlines()[1].strip() in line for line in printed) == 1
    monkeypatch.setenv(refusal_line.TRACEBACK_ENV, "0")
    print_refusal(error, frames)
    assert capsys.readouterr().err.splitlines() == [one_line(error)]


@pytest.fixture
def hook(monkeypatch):
    """lazyzero's hook for uncaught errors, installed over `sys.__excepthook__` for the test only."""
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setattr(refusal_line, "_refusal_types", set())
    register_refusals(CheckpointDamagedError)
    job_failure.end_job_on_uncaught_error(timedelta(seconds=5))
    return sys.excepthook


def test_the_uncaught_refusal_is_its_line_and_any_other_error_its_traceback(hook, capsys):
    hook(*raised(CheckpointDamagedError(DAMAGED)))
    refused = capsys.readouterr().err.splitlines()
    assert refused[-1].startswith("lazyzero: CheckpointDamagedError: ") and "CheckpointDamagedError:" not in refused[-2]
    hook(*raised(KeyError("other")))
    assert capsys.readouterr().err.splitlines()[-1] == "KeyError: 'other'"
