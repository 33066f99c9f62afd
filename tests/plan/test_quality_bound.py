"""The gradient error bound in the planner (docs/plan.md, "Quality"): a width whose measured error on a
layer exceeds `plan.max_grad_error` is not among that layer's options (`LayerCosts.act_widths`), in
the MILP, the greedy plan, the baselines and the simulator; the other layers keep every width."""

import pytest

from lazyzero.plan import (
    LayerCosts,
    LayerPlan,
    Machine,
    PlanInfeasible,
    PlanProblem,
    Tier,
    deepspeed_default_plan,
    fixed_rule_plan,
    greedy_plan,
    simulate,
    solve,
)
from lazyzero.plan.solver.problem import activation_options
from lazyzero.plan.solver.simulate import evaluate_layers

GB = 10**9
SENSITIVE = 1  # the layer whose 4-bit error is over the bound
WORKSPACE = GB // 10


def layer(i: int, act_widths=(16, 8, 4)) -> LayerCosts:
    """Equal layers but for the sensitive one, whose activations are twice as large: without the
    bound, narrowing it frees the most memory, so a tight budget would take 4 bits from it first."""
    act16 = (2 if i == SENSITIVE else 1) * GB
    return LayerCosts(f"model.layers.{i}", fwd_s=1e-3, bwd_s=2e-3, act_bytes={16: act16, 8: act16 // 2, 4: act16 // 4},
                      input_bytes=act16 // 20, param_bytes=GB // 100, grad_bytes=GB // 100,
                      optim_state_bytes_fp32=6 * GB // 100, optim_state_bytes_8bit=3 * GB // 100,
                      quality_cost={16: 0.0, 8: 1e-4, 4: 5e-4}, act_widths=act_widths)


def problem(capacity: float, bounded: bool = True, allow_recompute: bool = False, **options) -> PlanProblem:
    """Four layers on a device with no other tier (activations cannot leave it), fp32 states."""
    layers = [layer(i, (16, 8) if bounded and i == SENSITIVE else (16, 8, 4)) for i in range(4)]
    return PlanProblem(layers, Machine({"gpu": Tier("gpu", round(capacity))}, {}, 0.0, 0.0), WORKSPACE,
                       allow_recompute=allow_recompute, allow_8bit_optimizer=False, **options)


def peak(widths: list[int]) -> float:
    """Compute-memory peak of the plan keeping layer i's activations at widths[i] on the device."""
    loose = problem(1e15, bounded=False)
    layers = [LayerPlan("keep", bits, "gpu", "gpu", "gpu", False) for bits in widths]
    return evaluate_layers(loose, layers, "greedy").predicted_peak_bytes["gpu"]


# Just room for the sensitive layer at 8 bits and the others at 4: the only plan the bound leaves.
TIGHT = peak([4, 8, 4, 4])


def test_the_sensitive_layer_is_offered_no_width_over_the_bound():
    tight = problem(TIGHT)
    assert {o.bits for o in activation_options(tight, SENSITIVE)} == {16, 8}
    assert {o.bits for o in activation_options(tight, 0)} == {16, 8, 4}
    assert tight.layer_widths(SENSITIVE) == (16, 8)


@pytest.mark.parametrize("planner", [solve, greedy_plan])
def test_under_a_tight_budget_the_others_get_4_bits_and_the_sensitive_layer_8(planner):
    plan = planner(problem(TIGHT))
    assert [lp.act_bits for lp in plan.layers] == [4, 8, 4, 4]
    assert all(lp.act_mode == "keep" for lp in plan.layers)


def test_without_the_bound_the_same_budget_takes_4_bits_from_the_sensitive_layer():
    """What the bound prevents: its 4 bits free the most memory, so the unbounded optimum uses them."""
    plan = solve(problem(TIGHT, bounded=False), max_gap=0.0)
    assert plan.layers[SENSITIVE].act_bits == 4


def test_where_only_4_bits_everywhere_fits_there_is_no_plan_under_the_bound():
    everywhere_4 = peak([4, 4, 4, 4])
    assert solve(problem(everywhere_4, bounded=False)).layers[SENSITIVE].act_bits == 4
    for planner in (solve, greedy_plan):
        with pytest.raises(PlanInfeasible):
            planner(problem(everywhere_4))


def test_a_layer_left_with_no_allowed_width_recomputes():
    """The run allows only 4 bits, which the bound takes from the sensitive layer: recompute, exact,
    remains; without recompute the problem says which layer has no option left."""
    only_4 = problem(1e15, allow_recompute=True, allowed_bits=(4,))
    assert only_4.layer_widths(SENSITIVE) == ()
    for planner in (solve, greedy_plan):
        plan = planner(only_4)
        assert [(lp.act_mode, lp.act_bits) for lp in plan.layers] == [("keep", 4), ("recompute", 16), ("keep", 4),
                                                                      ("keep", 4)]
    with pytest.raises(ValueError, match="^allowed_bits: layer model.layers.1 may store"):
        problem(1e15, allowed_bits=(4,))


def test_the_simulator_refuses_a_plan_over_the_bound_and_the_baselines_respect_it():
    tight = problem(1e15)
    over = [LayerPlan("keep", 4, "gpu", "gpu", "gpu", False)] * 4
    with pytest.raises(ValueError, match="model.layers.1 keeps its activations at 4 bits"):
        evaluate_layers(tight, over, "greedy")
    for plan in (fixed_rule_plan(tight, 2), deepspeed_default_plan(tight)):
        simulate(tight, plan)
        assert all(lp.act_bits in costs.act_widths for costs, lp in zip(tight.layers, plan.layers))


def test_a_given_plan_over_the_bound_is_refused_naming_the_setting(tmp_path):
    from lazyzero.plan.deepspeed.engine_setup import given_plan

    loose = problem(1e15, bounded=False)
    over = evaluate_layers(loose, [LayerPlan("keep", 4, "gpu", "gpu", "gpu", False)] * 4, "greedy")
    (tmp_path / "plan.json").write_text(over.to_json())
    assert given_plan(loose, str(tmp_path / "plan.json")).layers == over.layers
    with pytest.raises(ValueError, match="plan_path: .*model.layers.1 keeps its activations at 4 bits.*max_grad_error"):
        given_plan(problem(1e15), str(tmp_path / "plan.json"))
