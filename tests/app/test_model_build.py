"""When `lazyzero train` builds its model partitioned across the ranks (lazyzero/app/model_build.py,
docs/plan.md "Planning partitioned models"); the partitioned build itself is exercised in
tests/plan/test_partitioned_models.py."""

import argparse

import pytest

from lazyzero.app.model_build import zero_init_config

STAGE_3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def args(model: str, choice: str) -> argparse.Namespace:
    return argparse.Namespace(model=model, family=None, seq_len=64, zero_init=choice)


def test_auto_partitions_only_large_models_under_stage_3():
    assert zero_init_config(args("demo", "auto"), STAGE_3, 259) is None  # 77 MB whole: built whole
    assert zero_init_config(args("1b", "auto"), STAGE_3, 32000) is STAGE_3  # 4.4 GB whole
    assert zero_init_config(args("1b", "auto"), {"zero_optimization": {"stage": 2}}, 32000) is None
    assert zero_init_config(args("1b", "auto"), None, 32000) is None


def test_on_and_off_are_obeyed_and_on_needs_stage_3():
    assert zero_init_config(args("tiny", "on"), STAGE_3, 259) is STAGE_3
    assert zero_init_config(args("7b", "off"), STAGE_3, 32000) is None
    with pytest.raises(ValueError, match="allowed: 3"):
        zero_init_config(args("tiny", "on"), {"zero_optimization": {"stage": 2}}, 259)
