"""Planner (docs/plan.md): problem validation, the step simulator, the MILP against brute force, the greedy
plan and the baselines checked against every budget."""

import dataclasses
import itertools
import random
import time
from collections import Counter

import pytest

from lazyzero.plan import (
    BudgetExceeded,
    LayerCosts,
    LayerPlan,
    Machine,
    Path,
    Plan,
    PlanInfeasible,
    PlanProblem,
    Tier,
    build_model,
    check_within_budgets,
    deepspeed_default_plan,
    fixed_rule_plan,
    greedy_plan,
    simulate,
    solve,
)
from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD, decoder_layer_name, problem_from_preset
from lazyzero.plan.solver.instances import llama_like_80_layers
from lazyzero.plan.solver.problem import Placement, activation_options
from lazyzero.plan.solver.simulate import evaluate_layers
from lazyzero.testing import TOLERANCES

GB = 10**9
FREE_LINKS = 1e18  # bytes/s: every copy hides under the compute
SLOW_LINKS = 1e6   # bytes/s: any copy of a layer costs hundreds of seconds
PRESET_SPEEDS = dict(gpu_tflops=400, h2d_gbps=25, d2h_gbps=25, nvme_read_gbps=3, nvme_write_gbps=2)


def machine(gpu, cpu=None, nvme=None, bandwidth=25e9, cpu_adam=1 / 12e9, gpu_adam=1 / 1e12):
    tiers = {"gpu": Tier("gpu", int(gpu))}
    paths = {}
    if cpu is not None:
        tiers["cpu"] = Tier("cpu", int(cpu))
        paths.update(d2h=Path("d2h", bandwidth), h2d=Path("h2d", bandwidth))
    if nvme is not None:
        tiers["nvme"] = Tier("nvme", int(nvme))
        paths.update(nvme_write=Path("nvme_write", bandwidth / 5), nvme_read=Path("nvme_read", bandwidth / 3))
    return Machine(tiers, paths, cpu_adam, gpu_adam)


def random_layer(rng, name):
    act16 = rng.randint(2, 8) * GB // 10
    params = rng.randint(1, 4) * GB // 20
    return LayerCosts(name, fwd_s=rng.uniform(1e-3, 4e-3), bwd_s=rng.uniform(2e-3, 8e-3),
                      act_bytes={16: act16, 8: act16 // 2, 4: act16 // 4}, input_bytes=act16 // 20,
                      param_bytes=2 * params, grad_bytes=2 * params, optim_state_bytes_fp32=12 * params,
                      optim_state_bytes_8bit=6 * params,
                      quality_cost={16: 0.0, 8: rng.uniform(0, 2e-3), 4: rng.uniform(2e-3, 6e-3)})


def all_on_device_bytes(layers, workspace):
    return workspace + sum(c.act_bytes[16] + c.param_bytes + c.grad_bytes + c.optim_state_bytes_fp32 for c in layers)


def random_problem(seed, num_layers, gpu_fraction, tiers=("cpu", "nvme"), bandwidth=25e9, **options):
    rng = random.Random(seed)
    layers = [random_layer(rng, f"layer{i}") for i in range(num_layers)]
    workspace = GB // 10
    need = all_on_device_bytes(layers, workspace)
    host = {t: 2 * need for t in tiers}
    return PlanProblem(layers, machine(gpu_fraction * need, bandwidth=bandwidth, **host), workspace, **options)


def brute_force_plan(problem, placements, allowed=lambda layers: True):
    """Best plan over every combination of per-layer choices that `allowed` accepts and the
    simulator finds within budget, with the rule-based (just-in-time) transfer schedule."""
    per_layer = [list(itertools.product(activation_options(problem, i), placements))
                 for i in range(problem.num_layers)]
    best = None
    for combination in itertools.product(*per_layer):
        layers = [LayerPlan.of(*choice) for choice in combination]
        if not allowed(layers):
            continue
        plan = evaluate_layers(problem, layers, "greedy")
        try:
            check_within_budgets(problem, plan)
        except BudgetExceeded:
            continue
        if best is None or plan.objective < best.objective:
            best = plan
    return best


def brute_force(problem, placements):
    """The brute-force optimum's objective (None if no combination fits)."""
    best = brute_force_plan(problem, placements)
    return None if best is None else best.objective


def every_placement(problem):
    tiers = list(problem.machine.tiers)
    widths = (False, True) if problem.allow_8bit_optimizer else (False,)
    return [Placement(p, s, w) for p in tiers for s in tiers for w in widths]


@pytest.mark.parametrize("seed,num_layers,gpu_fraction,tiers,allowed_bits,allow_8bit", [
    (0, 2, 0.3, ("cpu", "nvme"), (16, 8, 4), True),
    (1, 2, 0.3, ("cpu", "nvme"), (16, 8, 4), True),
    (2, 3, 0.3, ("cpu",), (16, 8), False),
    (3, 3, 0.3, ("cpu",), (16, 8), False),
    (4, 3, 0.5, ("nvme",), (16, 4), False),  # a CPU-only machine: "gpu" is the host memory
])
def test_milp_matches_brute_force_when_copies_are_free(seed, num_layers, gpu_fraction, tiers, allowed_bits,
                                                       allow_8bit):
    problem = random_problem(seed, num_layers, gpu_fraction, tiers=tiers, bandwidth=FREE_LINKS,
                             allowed_bits=allowed_bits, allow_8bit_optimizer=allow_8bit,
                             checkpoint_bytes_per_step=GB)
    expected = brute_force(problem, every_placement(problem))
    assert expected is not None, "the instance must have a plan"
    plan = solve(problem, max_gap=0.0)
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(expected, rel=TOLERANCES["planner_objective"])


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_milp_matches_brute_force_when_copies_are_slow(seed):
    problem = random_problem(seed, 3, gpu_fraction=0.75, bandwidth=SLOW_LINKS)
    on_device = [p for p in every_placement(problem) if p.param_tier == p.state_tier == "gpu"]
    expected = brute_force(problem, on_device)
    assert expected is not None, "the instance must fit without copies"
    plan = solve(problem, max_gap=0.0)
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(expected, rel=TOLERANCES["planner_objective"])


def test_greedy_is_feasible_and_milp_is_no_worse():
    for seed in range(10):  # about 0.7 s a seed
        problem = random_problem(100 + seed, num_layers=4, gpu_fraction=random.Random(seed).uniform(0.25, 0.6),
                                 checkpoint_bytes_per_step=GB // 2)
        greedy = greedy_plan(problem)
        check_within_budgets(problem, greedy)
        best = solve(problem, time_limit_s=5, warm_start=greedy)
        check_within_budgets(problem, best)
        assert best.objective <= greedy.objective * (1 + TOLERANCES["planner_objective"]), seed


@pytest.mark.parametrize("tiers,gpu_fraction", [(("cpu", "nvme"), 0.35), (("nvme",), 0.5)],
                         ids=["gpu_host_nvme", "cpu_only_machine"])
def test_every_plan_is_within_budgets_and_predictions_hold(tiers, gpu_fraction):
    """Budgets leave room for the baselines too (on a CPU-only machine they keep every gradient in
    the compute memory)."""
    problem = random_problem(11, 8, gpu_fraction, tiers=tiers, checkpoint_bytes_per_step=GB)
    plans = [solve(problem), greedy_plan(problem), fixed_rule_plan(problem, 3), deepspeed_default_plan(problem)]
    assert [p.source for p in plans] == ["milp", "greedy", "fixed_rule", "deepspeed_default"]
    for plan in plans:
        simulation = check_within_budgets(problem, plan)
        assert simulation.step_s == pytest.approx(plan.predicted_step_s, rel=TOLERANCES["planner_step_time"])
        for tier, peak in simulation.peak_bytes.items():
            assert peak <= plan.predicted_peak_bytes[tier] * (1 + TOLERANCES["planner_step_time"]) + 1, tier
    assert plans[0].objective <= min(p.objective for p in plans[1:]) * (1 + TOLERANCES["planner_objective"])


def activation_heavy_problem(tiers):
    """Eight layers whose activations dwarf everything else, with neither recompute nor narrower
    widths: the plan must offload most activations, and at 50 GB/s their copies outgrow a window."""
    rng = random.Random(0)
    layers = []
    for i in range(8):
        act16, params = rng.randint(4, 8) * GB // 10, GB // 100
        layers.append(LayerCosts(f"layer{i}", fwd_s=rng.uniform(1e-3, 4e-3), bwd_s=rng.uniform(2e-3, 8e-3),
                                 act_bytes={16: act16, 8: act16 // 2, 4: act16 // 4}, input_bytes=act16 // 20,
                                 param_bytes=2 * params, grad_bytes=2 * params, optim_state_bytes_fp32=12 * params,
                                 optim_state_bytes_8bit=6 * params, quality_cost={16: 0.0, 8: 1e-3, 4: 3e-3}))
    workspace = GB // 10
    need = all_on_device_bytes(layers, workspace)
    return PlanProblem(layers, machine(0.5 * need, bandwidth=50e9, **{t: 2 * need for t in tiers}), workspace,
                       allowed_bits=(16,), allow_recompute=False, checkpoint_bytes_per_step=GB)


@pytest.mark.parametrize("tiers", [("cpu",), ("cpu", "nvme")])
def test_offloaded_activations_split_into_a_schedule_the_simulator_confirms(tiers):
    """The MILP moves activation bytes per window summed over layers; the plan's per-layer schedule
    must put every layer's bytes in its allowed windows, in full, and load the paths exactly as
    the MILP predicted (simulated step time = predicted)."""
    problem = activation_heavy_problem(tiers)
    plan = solve(problem, max_gap=0.0)
    assert plan.status == "optimal"
    assert sum(lp.offloaded for lp in plan.layers) >= 5
    windows_per_copy = Counter((t.layer, t.direction) for t in plan.act_transfers)
    assert max(windows_per_copy.values()) > 1, "at 50 GB/s some copy must span several windows"
    simulation = check_within_budgets(problem, plan)
    assert simulation.step_s == pytest.approx(plan.predicted_step_s, rel=TOLERANCES["planner_step_time"])
    assert plan.objective <= greedy_plan(problem).objective * (1 + TOLERANCES["planner_objective"])


def test_infeasible_budget_names_the_tier():
    problem = random_problem(3, 3, gpu_fraction=0.001)
    for planner in (solve, greedy_plan):
        with pytest.raises(PlanInfeasible, match="gpu") as caught:
            planner(problem)
        assert "gpu" in caught.value.tiers
    tiny_host = PlanProblem(problem.layers, machine(problem.machine.tiers["gpu"].capacity_bytes * 300, cpu=1, nvme=1),
                            problem.workspace_bytes)
    with pytest.raises(PlanInfeasible) as caught:
        solve(tiny_host)
    assert set(caught.value.tiers) >= {"gpu"}


def test_constraints_are_named():
    problem = random_problem(0, 3, gpu_fraction=0.3, checkpoint_bytes_per_step=GB)
    model = build_model(problem).model
    for name in ("one_act[0]", "one_placement[2]", "gpu_capacity[b0]", "gpu_capacity[opt]", "cpu_capacity[b1]",
                 "nvme_capacity[b2]", "act_down[0,cpu]", "act_up[1,nvme]", "checkpoint_traffic",
                 "bandwidth[d2h,w0]", "act_buffer[1]", "exposed_floor[h2d,w0]", "count_state[gpu]"):
        assert model.constr_by_name(name) is not None, name


def offloading_problem(all_or_none):
    """Three decoder layers and embed_and_head, sized so that the best plan offloads the parameters
    of only some layers (parameters large next to their optimizer states, a slow host optimizer);
    under offload_all_or_none every layer's parameters are on the device or none are."""
    rng = random.Random(9)

    def layer(name, act16):
        params = rng.randint(1, 8) * GB // 10
        return LayerCosts(name, fwd_s=rng.uniform(1e-3, 4e-3), bwd_s=rng.uniform(2e-3, 8e-3),
                          act_bytes={16: act16, 8: act16 // 2, 4: act16 // 4}, input_bytes=act16 // 20,
                          param_bytes=params, grad_bytes=params, optim_state_bytes_fp32=params // 2,
                          optim_state_bytes_8bit=params // 4, quality_cost={16: 0.0, 8: 1e-3, 4: 3e-3})

    layers = [layer(decoder_layer_name(i), rng.randint(1, 8) * GB // 10) for i in range(3)]
    layers.append(layer(EMBED_AND_HEAD, 0))
    workspace = GB // 10
    need = all_on_device_bytes(layers, workspace)
    return PlanProblem(layers, machine(0.92 * need, cpu=2 * need, cpu_adam=1 / 1e9), workspace,
                       checkpoint_bytes_per_step=GB // 10, allowed_bits=(16,), allow_recompute=False,
                       allow_8bit_optimizer=False, offload_all_or_none=all_or_none)


def all_or_none(layers) -> bool:
    return all(len({getattr(lp, a) == "gpu" for lp in layers}) == 1 for a in ("param_tier", "state_tier"))


def test_offload_all_or_none_keeps_each_kind_on_the_device_everywhere_or_nowhere():
    free, ruled = offloading_problem(False), offloading_problem(True)
    best_free = brute_force_plan(free, every_placement(free))
    best_ruled = brute_force_plan(ruled, every_placement(ruled), allowed=all_or_none)
    # The instance is what it claims: the unconstrained optimum mixes, and the rule costs time.
    assert not all_or_none(best_free.layers)
    assert best_ruled.objective > best_free.objective * (1 + TOLERANCES["planner_objective"])
    for problem, expected in ((free, best_free), (ruled, best_ruled)):
        plan = solve(problem, max_gap=0.0)
        assert plan.status == "optimal"
        assert plan.objective == pytest.approx(expected.objective, rel=TOLERANCES["planner_objective"])
        check_within_budgets(problem, plan)
    assert all_or_none(solve(ruled, max_gap=0.0).layers)
    assert build_model(ruled).model.constr_by_name("offload_all_or_none[param,2]") is not None
    assert build_model(free).model.constr_by_name("offload_all_or_none[param,2]") is None
    with pytest.raises(ValueError, match="^offload_all_or_none: layers"):
        simulate(ruled, evaluate_layers(free, best_free.layers, "greedy"))


def test_greedy_offloads_a_kind_from_every_layer_at_once():
    """7b on 24 GB with 64 GB of host memory (the preset problem has the rule): the greedy plan and
    the MILP's offload (24 GB cannot hold 7b's states), from every layer, and stay within the budgets."""
    problem = problem_from_preset("7b", gpu_mem=24 * GB, cpu_mem=64 * GB, nvme_path=None, seq=4096, micro_batch=1,
                                  **PRESET_SPEEDS)
    assert problem.offload_all_or_none
    greedy = greedy_plan(problem)
    assert all_or_none(greedy.layers) and {lp.state_tier for lp in greedy.layers} == {"cpu"}
    check_within_budgets(problem, greedy)
    plan = solve(problem, time_limit_s=5, warm_start=greedy)
    assert all_or_none(plan.layers)
    check_within_budgets(problem, plan)
    assert plan.objective <= greedy.objective * (1 + TOLERANCES["planner_objective"])


def hand_problem():
    """Two layers with small round numbers whose memory per window is worked out by hand below."""
    def layer(name, act, param, state32):
        return LayerCosts(name, fwd_s=1.0, bwd_s=2.0, act_bytes={16: act, 8: act // 2, 4: act // 4}, input_bytes=10,
                          param_bytes=param, grad_bytes=param, optim_state_bytes_fp32=state32,
                          optim_state_bytes_8bit=state32 // 2, quality_cost={16: 0.0, 8: 0.5, 4: 1.0})

    return PlanProblem([layer("l0", 100, 20, 80), layer("l1", 200, 40, 160)],
                       machine(575, cpu=100, bandwidth=10.0, cpu_adam=0.01, gpu_adam=0.001), workspace_bytes=5)


def test_simulator_memory_by_hand():
    problem = hand_problem()
    layers = [LayerPlan("keep", 16, "gpu", "gpu", "cpu", False),    # host optimizer: gradient leaves
              LayerPlan("recompute", 16, "gpu", "gpu", "gpu", False)]
    simulation = check_within_budgets(problem, evaluate_layers(problem, layers, "greedy"))
    # Device: workspace 5 + params 60 + layer 1's state 160 = 225; f0 +100 act; f1 +10 input;
    # b1 +40 gradient +200 recomputed activations; b0: -200 -10 +20 gradient; opt: -100 act.
    assert [w.memory["gpu"] for w in simulation.windows] == [325, 335, 575, 385, 285]
    # Host: layer 0's state, and its gradient arriving in the optimizer window.
    assert [w.memory["cpu"] for w in simulation.windows] == [80, 80, 80, 80, 100]
    # Compute 1, 1, 2+1 (backward plus recompute), 2, optimizer 80 * 0.01 + 160 * 0.001. Copies in the optimizer
    # window: gradient down (20 B at 10 B/s) and the updated parameters up (20 B): 2 s each, hidden.
    assert [w.compute_s for w in simulation.windows] == pytest.approx([1, 1, 3, 2, 0.96])
    assert simulation.windows[4].exposed_s == pytest.approx(2 - 0.96)
    assert simulation.step_s == pytest.approx(1 + 1 + 3 + 2 + 2)
    over_budget = PlanProblem(problem.layers, machine(574, cpu=100, bandwidth=10.0), workspace_bytes=5)
    with pytest.raises(BudgetExceeded, match="gpu budget exceeded in window b1"):
        check_within_budgets(over_budget, evaluate_layers(over_budget, layers, "greedy"))


def with_engine_excess(problem, excess):
    layers = tuple(dataclasses.replace(c, engine_excess_bytes=excess) for c in problem.layers)
    return dataclasses.replace(problem, layers=layers)


@pytest.mark.parametrize("param_tier,state_tier,held", [
    ("gpu", "gpu", 7), ("gpu", "cpu", 0), ("cpu", "gpu", 0), ("cpu", "cpu", 0)])
def test_engine_excess_is_held_only_where_parameters_and_state_stay_in_memory(param_tier, state_tier, held):
    """The calibration engines' per-layer excess (calibrate.engine_memory_excess) is charged to a layer
    only under the placement those engines had; the MILP's resident memory counts the same."""
    plain = hand_problem()
    problem = with_engine_excess(plain, 7)
    layers = [LayerPlan("keep", 16, "gpu", param_tier, state_tier, False),
              LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)]
    with_excess = simulate(problem, evaluate_layers(problem, layers, "greedy"))
    without = simulate(plain, evaluate_layers(plain, layers, "greedy"))
    assert [w.memory["gpu"] - v.memory["gpu"] for w, v in zip(with_excess.windows, without.windows)] == \
        [held + 7] * len(without.windows)
    assert [w.memory["cpu"] for w in with_excess.windows] == [v.memory["cpu"] for v in without.windows]


@pytest.mark.parametrize("seed", [0, 1])
def test_milp_matches_brute_force_with_engine_excess(seed):
    plain = random_problem(seed, 2, 0.3, bandwidth=FREE_LINKS, allowed_bits=(16, 8), allow_8bit_optimizer=True,
                           checkpoint_bytes_per_step=GB)
    problem = with_engine_excess(plain, plain.layers[0].param_bytes)
    expected = brute_force(problem, every_placement(problem))
    assert expected is not None, "the instance must have a plan"
    plan = solve(problem, max_gap=0.0)
    assert plan.objective == pytest.approx(expected, rel=TOLERANCES["planner_objective"])
    check_within_budgets(problem, plan)


def test_simulator_rejects_an_incomplete_schedule():
    problem = hand_problem()
    layers = [LayerPlan("keep", 8, "cpu", "gpu", "gpu", False), LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)]
    plan = evaluate_layers(problem, layers, "greedy")
    truncated = Plan(plan.layers, plan.act_transfers[:1], plan.checkpoint_transfers, plan.predicted_step_s,
                     plan.predicted_peak_bytes, plan.objective, plan.source, plan.status)
    with pytest.raises(ValueError, match="layer 0 activations up"):
        simulate(problem, truncated)


def test_solve_prints_nothing(capfd):
    """CBC's LP solver logs to the process's stdout whatever python-mip's verbose says; `lazyzero
    plan` prints a table there, so solve silences it."""
    solve(random_problem(2, 4, gpu_fraction=0.3, checkpoint_bytes_per_step=GB))
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == ""


def test_plan_json_round_trip():
    problem = random_problem(2, 4, gpu_fraction=0.3, checkpoint_bytes_per_step=GB)
    plan = solve(problem)
    assert Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("make,field", [
    (lambda: Tier("hbm", 1), "name"),
    (lambda: Path("d2h", 0), "bytes_per_s"),
    (lambda: Machine({"gpu": Tier("gpu", 1), "cpu": Tier("cpu", 1)}, {}, 0, 0), "paths"),
    (lambda: LayerCosts("x", -1, 1, {16: 1, 8: 1, 4: 1}, 1, 1, 1, 1, 1, {16: 0, 8: 0, 4: 0}), "fwd_s"),
    (lambda: LayerCosts("x", 1, 1, {16: 1, 8: 1}, 1, 1, 1, 1, 1, {16: 0, 8: 0, 4: 0}), "act_bytes"),
    (lambda: LayerCosts("x", 1, 1, {16: 1, 8: 1, 4: 1}, 1, 1, 1, 1, 1, {16: 0, 8: 0, 4: 0}, act_widths=(8, 4)),
     "act_widths"),
    (lambda: LayerCosts("x", 1, 1, {16: 1, 8: 1, 4: 1}, 1, 1, 1, 1, 1, {16: 0, 8: 0, 4: 0}, grad_error={8: 0.1}),
     "grad_error"),
    (lambda: random_problem(0, 2, 0.5, allowed_bits=(12,)), "allowed_bits"),
    (lambda: LayerPlan("recompute", 8, "gpu", "gpu", "gpu", False), "act_mode"),
])
def test_validation_errors_name_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        make()


@pytest.mark.slow
@pytest.mark.parametrize("all_or_none", [False, True])
def test_solve_s_80_layers(all_or_none):
    problem = llama_like_80_layers(all_or_none)
    greedy = greedy_plan(problem)
    started = time.perf_counter()
    plan = solve(problem, time_limit_s=10, max_gap=0.01, warm_start=greedy)
    elapsed = time.perf_counter() - started
    print(f"80 layers: {elapsed:.1f} s, status {plan.status}, gap {plan.gap:.4f}, objective {plan.objective:.4f} "
          f"(greedy {greedy.objective:.4f}, fixed rule {fixed_rule_plan(problem, 4).objective:.4f})")
    assert plan.status in ("optimal", "feasible")
    assert 0 <= plan.gap
    check_within_budgets(problem, plan)
    assert plan.objective <= greedy.objective


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_headroom_share_places_the_budget_between_the_least_with_a_plan_and_all_in_memory(share):
    """`plan.headroom_share`: the capacity lies `share` of the way from the least capacity that
    admits a plan to the all-in-memory plan's peak; a plan exists there, and none a little below
    the least (so the least is the real edge, not a loose bound)."""
    from lazyzero.plan.deepspeed.calibrate import all_in_memory_peak, headroom_budget, with_compute_capacity

    problem = random_problem(7, 4, gpu_fraction=0.05, tiers=("cpu",))
    budget = headroom_budget(problem, share)
    assert budget.in_memory_bytes == all_in_memory_peak(problem)
    assert 0 < budget.least_bytes < budget.in_memory_bytes
    assert budget.capacity_bytes == pytest.approx(
        budget.least_bytes + share * (budget.in_memory_bytes - budget.least_bytes), abs=1)
    plan = solve(with_compute_capacity(problem, budget.capacity_bytes))
    assert plan.predicted_peak_bytes["gpu"] <= budget.capacity_bytes
    with pytest.raises(PlanInfeasible):
        solve(with_compute_capacity(problem, 0.97 * budget.least_bytes))
