"""`plan.price_int8_gradients` (plan/deepspeed/priced_gradients.py): a planned run keeps the int8
exchange only where its profile measured it faster per byte than DeepSpeed's reduce-scatter; where it
switches it off, the problem holds neither its time nor its residuals."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
from test_problem_from_profile import made_up_profile

from lazyzero.config import LazyZeroConfigError, validate_ds_config
from lazyzero.plan.deepspeed.priced_gradients import int8_gradients_priced
from lazyzero.plan.deepspeed.problem_from_profile import feature_workspace_bytes
from lazyzero.plan.profile.data import CollectiveSpeed

PRICED = SimpleNamespace(price_int8_gradients=True)


def profile_with_exchange(int8_s_per_byte: float, error_feedback: bool = True):
    profile = made_up_profile()
    theirs = profile.machine.collectives["reduce_scatter"]
    name = "int8_reduce_scatter_error_feedback" if error_feedback else "int8_reduce_scatter"
    int8 = CollectiveSpeed(theirs.world_size, theirs.dtype, theirs.full_bytes, int8_s_per_byte * theirs.full_bytes,
                           int8_s_per_byte)
    machine = replace(profile.machine, collectives={**profile.machine.collectives, name: int8})
    return replace(profile, machine=machine)


def config(error_feedback: bool = True) -> dict:
    return {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
            "lazyzero": {"gradients": {"enabled": True, "error_feedback": error_feedback, "block_size": 128}}}


def test_a_slower_exchange_is_switched_off_with_its_memory_and_the_reason():
    profile = profile_with_exchange(3.5e-9)  # DeepSpeed's reduce-scatter: 2e-9 s per byte
    decided, line = int8_gradients_priced(profile, config(), PRICED)
    assert decided["lazyzero"]["gradients"] == {"enabled": False}
    assert "int8 gradients off" in line and "with error feedback" in line and "(1.75 x)" in line
    assert feature_workspace_bytes(profile, config(), None) > 0
    assert feature_workspace_bytes(profile, decided, None) == 0
    assert config()["lazyzero"]["gradients"]["enabled"] is True  # the user's config is not changed


@pytest.mark.parametrize("error_feedback", [True, False])
def test_a_faster_exchange_is_kept_as_configured(error_feedback):
    given = config(error_feedback)
    decided, line = int8_gradients_priced(profile_with_exchange(1e-9, error_feedback), given, PRICED)
    assert decided == given and "int8 gradients kept" in line and "(0.50 x)" in line


def test_the_feedback_variant_is_the_one_priced():
    # Measured without error feedback only: a run with feedback has nothing to be priced by.
    decided, line = int8_gradients_priced(profile_with_exchange(1e-9, error_feedback=False), config(), PRICED)
    assert decided["lazyzero"]["gradients"]["enabled"] is False and "measured no" in line


def test_without_the_setting_the_section_stays_as_written():
    decided, line = int8_gradients_priced(profile_with_exchange(9e-9), config(),
                                          SimpleNamespace(price_int8_gradients=False))
    assert decided == config() and line is None


def test_the_setting_needs_int8_gradients_on():
    ds_config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
                 "lazyzero": {"plan": {"enabled": True, "seq_len": 8, "price_int8_gradients": True}}}
    with pytest.raises(LazyZeroConfigError, match=r"lazyzero\.plan\.price_int8_gradients: got true; allowed: false "
                                                  r"unless lazyzero\.gradients\.enabled is true"):
        validate_ds_config(ds_config)
