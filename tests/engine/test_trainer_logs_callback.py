"""TrainerLogsCallback's step time (lazyzero/engine/trainer_logs.py) with any engine, DeepSpeed's own
included: the benchmarks compare a plain DeepSpeed run's steps with a planned run's through it."""

import time
from types import SimpleNamespace

import pytest

from lazyzero.engine import trainer_logs
from lazyzero.engine.trainer_logs import TrainerLogsCallback


def test_every_log_entry_gets_the_latest_steps_seconds_without_a_lazyzero_engine(monkeypatch):
    monkeypatch.setattr(trainer_logs, "newest_engine", lambda: None)
    clock = iter([100.0, 102.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    callback = TrainerLogsCallback()
    state = SimpleNamespace(global_step=1, log_history=[{"loss": 1.0, "step": 1}])
    callback.on_step_begin(None, state, None)
    callback.on_step_end(None, state, None)
    logs = {"loss": 1.0}
    callback.on_log(None, state, None, logs=logs)
    assert logs["lazyzero/step_s"] == pytest.approx(2.5)
    assert state.log_history[-1]["lazyzero/step_s"] == pytest.approx(2.5)


def test_no_step_yet_adds_nothing(monkeypatch):
    monkeypatch.setattr(trainer_logs, "newest_engine", lambda: None)
    logs = {}
    TrainerLogsCallback().on_log(None, SimpleNamespace(global_step=0, log_history=[]), None, logs=logs)
    assert logs == {}
