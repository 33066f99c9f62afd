"""Means and ratios with 95% confidence intervals, for benchmarks whose timings drift.

A difference of paired measurements (a block of steps with a checkpoint in flight against the
adjacent block without, ABBA order) is summarized by its mean and a Student t interval. A ratio of
two such means is reported with the interval that the two intervals imply (numerator low over
denominator high, numerator high over denominator low): conservative, and it needs no assumption
about how the two are correlated. When the denominator's interval includes zero the ratio is not
resolved: only a lower bound is reported (benchmarks/README.md, "bench_checkpoint").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom (any statistics table).
_T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
          2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
          2.045, 2.042)
_Z_975 = 1.960


def t_quantile_975(degrees_of_freedom: int) -> float:
    if degrees_of_freedom < 1:
        raise ValueError(f"a t interval needs at least 2 values, got {degrees_of_freedom + 1}")
    return _T_975[degrees_of_freedom - 1] if degrees_of_freedom <= len(_T_975) else _Z_975


@dataclass(frozen=True)
class Interval:
    """An estimate and its 95% confidence interval; `high` is None for an unbounded interval."""

    value: float
    low: float
    high: float | None
    resolved: bool = True

    def as_dict(self) -> dict:
        return asdict(self)


def mean_interval(values: list[float]) -> Interval:
    """The mean of `values` and its Student t interval."""
    mean = statistics.fmean(values)
    half_width = t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, mean - half_width, mean + half_width)


def ratio_interval(numerator: Interval, denominator: Interval) -> Interval:
    """numerator / denominator for two positive quantities. Resolved only when the denominator's
    interval excludes zero; otherwise `value` is the lower bound numerator.low / denominator.high
    (zero when that is not positive) and `high` is None."""
    if denominator.low <= 0:
        bound = numerator.low / denominator.high if denominator.high and denominator.high > 0 else 0.0
        return Interval(max(bound, 0.0), max(bound, 0.0), None, resolved=False)
    low = max(numerator.low, 0.0) / (denominator.high if denominator.high is not None else math.inf)
    high = numerator.high / denominator.low if numerator.high is not None else None
    return Interval(numerator.value / denominator.value, low, high)


def describe(interval: Interval, digits: int = 3) -> str:
    """'12.3 (95% CI 9.1-15.8)', or '>= 4.2 (unresolved)'."""
    if not interval.resolved:
        return f">= {interval.value:.{digits}g} (unresolved)"
    high = "inf" if interval.high is None else f"{interval.high:.{digits}g}"
    return f"{interval.value:.{digits}g} (95% CI {interval.low:.{digits}g}-{high})"
