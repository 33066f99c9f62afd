"""A re-plan keeps what training computes (plan/deepspeed/calibrate.py, `calibrated_problem`): each
layer's activation width stays (a packed layer its width, an exact one 16 bits or recompute), so that
a run's losses do not depend on when its measurements crossed the margin and a resumed run repeats
the uninterrupted one's. Only where no plan keeps them within the budget may they change
(monitor.py), and the first plan of two launches of one job is the same (engine_setup.py)."""

from __future__ import annotations

import pytest
from test_planner_problem import random_problem

from lazyzero.plan import solve
from lazyzero.plan.deepspeed.calibrate import calibrated_problem, predicted_compute_peak, with_free_widths
from lazyzero.plan.deepspeed.engine_setup import PROCESS_BYTES_STEP, rounded_process_bytes
from lazyzero.plan.solver.problem import RECOMPUTE, activation_options


def computed_widths(plan) -> list[int]:
    """Per layer, the width training computes with: a recomputed layer is exact, as at 16 bits."""
    return [lp.act_bits if lp.act_mode == "keep" else 16 for lp in plan.layers]


def first_plan_and_replan_problem(seed: int):
    problem = random_problem(seed, 6, 0.6, allowed_bits=(16, 8, 4))
    plan = solve(problem, max_gap=0.0)
    slower = calibrated_problem(problem, plan, plan.predicted_step_s * 1.3,
                                predicted_compute_peak(problem, plan, False) * 1.08, False)
    return plan, slower


@pytest.mark.parametrize("seed", [0, 3, 5, 7])
def test_a_replan_keeps_each_layers_width_where_a_free_one_would_change_them(seed):
    plan, slower = first_plan_and_replan_problem(seed)
    kept, free = solve(slower, max_gap=0.0), solve(with_free_widths(slower), max_gap=0.0)
    assert computed_widths(kept) == computed_widths(plan)
    # The same measurements, planned with free widths, change some layer's: what the rule prevents.
    assert computed_widths(free) != computed_widths(plan)


def test_a_packed_layer_cannot_be_recomputed_and_an_exact_one_cannot_be_packed():
    plan, slower = first_plan_and_replan_problem(5)
    for i, lp in enumerate(plan.layers):
        options = activation_options(slower, i)
        if lp.act_mode == "keep" and lp.act_bits < 16:
            assert {o.bits for o in options} == {lp.act_bits} and RECOMPUTE not in options
        else:
            assert {o.bits for o in options} == {16} and RECOMPUTE in options


@pytest.mark.parametrize("measured", [1, PROCESS_BYTES_STEP - 1, PROCESS_BYTES_STEP, 700 * 2**20 + 12345])
def test_the_process_enters_the_plan_rounded_up_so_that_launches_a_few_mb_apart_plan_alike(measured):
    rounded = rounded_process_bytes(measured)
    assert rounded % PROCESS_BYTES_STEP == 0 and measured <= rounded < measured + PROCESS_BYTES_STEP
    assert rounded_process_bytes(-5) == 0
