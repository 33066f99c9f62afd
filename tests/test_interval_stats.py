"""benchmarks/interval_stats.py: the intervals bench_checkpoint reports its stalls and ratios with."""

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from interval_stats import Interval, describe, mean_interval, ratio_interval, t_quantile_975  # noqa: E402


def test_mean_interval_matches_the_t_formula():
    values = [1.0, 2.0, 3.0, 4.0]
    interval = mean_interval(values)
    half = 3.182 * math.sqrt(5 / 3) / 2  # sample sd sqrt(5/3), n 4, t(3) 3.182
    assert interval.value == 2.5
    assert interval.low == pytest.approx(2.5 - half) and interval.high == pytest.approx(2.5 + half)


def test_mean_interval_covers_the_true_mean_about_95_percent_of_the_time():
    rng = random.Random(0)
    trials = 2000
    covered = 0
    for _ in range(trials):
        interval = mean_interval([rng.gauss(1.0, 0.5) for _ in range(6)])
        covered += interval.low <= 1.0 <= interval.high
    assert 0.93 <= covered / trials <= 0.97


def test_one_value_has_no_interval():
    with pytest.raises(ValueError, match="at least 2 values"):
        t_quantile_975(0)


def test_ratio_with_a_denominator_away_from_zero_is_resolved():
    ratio = ratio_interval(Interval(4.0, 3.0, 5.0), Interval(0.2, 0.1, 0.3))
    assert ratio.resolved and ratio.value == pytest.approx(20.0)
    assert ratio.low == pytest.approx(10.0) and ratio.high == pytest.approx(50.0)
    assert describe(ratio) == "20 (95% CI 10-50)"


def test_ratio_whose_denominator_may_be_zero_is_only_a_lower_bound():
    ratio = ratio_interval(Interval(4.0, 3.0, 5.0), Interval(0.1, -0.2, 0.4))
    assert not ratio.resolved and ratio.high is None
    assert ratio.value == pytest.approx(7.5)  # 3.0 / 0.4
    assert describe(ratio) == ">= 7.5 (unresolved)"


def test_ratio_with_nothing_positive_to_bound_it_is_zero():
    assert ratio_interval(Interval(1.0, -1.0, 3.0), Interval(0.0, -1.0, 1.0)).value == 0.0
