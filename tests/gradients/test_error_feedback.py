"""`ErrorFeedback` bookkeeping and lazyzero's per-rank checkpoint file (no processes needed)."""

import pytest
import torch

from lazyzero.checkpoint.rank_state import load_rank_state, rank_state_document, rank_state_path
from lazyzero.gradients.error_feedback import ErrorFeedback

CPU = torch.device("cpu")


def test_each_call_of_a_step_keeps_its_own_residual_across_steps():
    feedback = ErrorFeedback(lambda: 1.0)
    first = feedback.residual(0, 5, CPU)
    second = feedback.residual(1, 3, CPU)
    first.fill_(1.0)
    second.fill_(2.0)
    assert feedback.residual(0, 5, CPU) is first and feedback.residual(1, 3, CPU) is second
    assert torch.equal(first, torch.ones(5))


def test_a_call_whose_size_changed_restarts_from_zero():
    feedback = ErrorFeedback(lambda: 1.0)
    feedback.residual(0, 5, CPU).fill_(1.0)
    resized = feedback.residual(0, 7, CPU)
    assert torch.equal(resized, torch.zeros(7))


def test_calls_out_of_order_are_a_bug_not_a_silent_new_residual():
    with pytest.raises(RuntimeError, match="exchange call 2 before call 0"):
        ErrorFeedback(lambda: 1.0).residual(2, 5, CPU)


def test_residuals_follow_a_changed_loss_scale():
    scale = {"now": 1024.0}
    feedback = ErrorFeedback(lambda: scale["now"])
    feedback.residual(0, 4, CPU).fill_(8.0)
    scale["now"] = 512.0
    assert torch.equal(feedback.residual(0, 4, CPU), torch.full((4,), 4.0))


def test_discard_zeroes_everything():
    feedback = ErrorFeedback(lambda: 1.0)
    feedback.residual(0, 4, CPU).fill_(3.0)
    feedback.discard()
    assert torch.equal(feedback.residual(0, 4, CPU), torch.zeros(4))


def test_state_dict_round_trip_restores_residuals_and_their_scale():
    feedback = ErrorFeedback(lambda: 2.0)
    feedback.residual(0, 4, CPU).copy_(torch.arange(4.0))
    restored = ErrorFeedback(lambda: 4.0)
    restored.load_state_dict(feedback.state_dict(), CPU)
    # Saved in units of loss scale 2; the restored run's scale is 4.
    assert torch.equal(restored.residual(0, 4, CPU), torch.arange(4.0) * 2)


def test_rank_state_file_round_trips_and_refuses_another_world_size(tmp_path):
    features = {"gradients": {"residuals": [torch.ones(3)]}}
    path = rank_state_path(tmp_path / "step2", 1)
    path.parent.mkdir()
    torch.save(rank_state_document(rank=1, world_size=4, features=features), path)
    loaded, why_not = load_rank_state(tmp_path / "step2", rank=1, world_size=4)
    assert why_not == "" and torch.equal(loaded["gradients"]["residuals"][0], torch.ones(3))
    loaded, why_not = load_rank_state(tmp_path / "step2", rank=1, world_size=2)
    assert loaded is None and "saved by a run of 4 ranks, this run has 2" in why_not
    loaded, why_not = load_rank_state(tmp_path / "step2", rank=0, world_size=4)
    assert loaded is None and "does not exist" in why_not
