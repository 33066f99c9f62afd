"""The cost terms that describe lazyzero's runtime on DeepSpeed (docs/plan.md): packing seconds per
width, a measured recompute, NVMe swaps that block, gradients that follow an NVMe optimizer state,
the swapper's staging bytes, 8-bit optimizer speeds, allowed parameter tiers and fixed placements.
The MILP and the step simulator must mean the same by each (brute force over the simulator on small
instances), and the simulator must mean what the rules say (a hand-computed instance)."""

import dataclasses
import itertools
import random

import pytest

from lazyzero.plan import (
    LayerCosts,
    LayerPlan,
    Machine,
    Path,
    PlanInfeasible,
    PlanProblem,
    Tier,
    greedy_plan,
    simulate,
    solve,
)
from lazyzero.plan.solver.problem import Placement, activation_options, placement_options
from lazyzero.plan.solver.simulate import BudgetExceeded, check_within_budgets, evaluate_layers
from lazyzero.testing import TOLERANCES

GB = 10**9
# Activation copies hide under any window at this speed, so the MILP's freedom to spread them over
# windows cannot beat the simulator's just-in-time schedule; placement swaps block whatever the speed.
FAST_DISK = 1e12


def runtime_layer(rng: random.Random, name: str) -> LayerCosts:
    act16, params = rng.randint(2, 8) * GB // 10, rng.randint(1, 4) * GB // 20
    fwd = rng.uniform(1e-3, 4e-3)
    return LayerCosts(name, fwd_s=fwd, bwd_s=2 * fwd, act_bytes={16: act16, 8: act16 // 2, 4: act16 // 4},
                      input_bytes=act16 // 20, param_bytes=2 * params, grad_bytes=4 * params,
                      optim_state_bytes_fp32=12 * params, optim_state_bytes_8bit=6 * params,
                      quality_cost={16: 0.0, 8: 1e-5, 4: 1e-4},
                      pack_fwd_s={16: 0.0, 8: rng.uniform(0, 3e-4), 4: rng.uniform(0, 3e-4)},
                      pack_bwd_s={16: 0.0, 8: rng.uniform(0, 6e-4), 4: rng.uniform(0, 6e-4)},
                      recompute_s=rng.uniform(0.5, 1.5) * fwd, stage_bytes_fp32=16 * params,
                      offload_fwd_s={16: 2e-4, 8: 1e-4, 4: 5e-5}, offload_bwd_s={16: 4e-4, 8: 2e-4, 4: 1e-4},
                      stage_bytes_8bit=16 * params)


def runtime_problem(seed: int, num_layers: int, gpu_fraction: float, **options) -> PlanProblem:
    """A machine without a GPU: compute memory under a budget, and NVMe, as lazyzero plans on CPU."""
    rng = random.Random(seed)
    layers = [runtime_layer(rng, f"layer{i}") for i in range(num_layers)]
    workspace = GB // 10
    need = workspace + sum(c.act_bytes[16] + c.param_bytes + c.grad_bytes + c.optim_state_bytes_fp32 for c in layers)
    tiers = {"gpu": Tier("gpu", int(gpu_fraction * need)), "nvme": Tier("nvme", 4 * need)}
    paths = {"nvme_write": Path("nvme_write", FAST_DISK / 4), "nvme_read": Path("nvme_read", FAST_DISK / 2)}
    machine = Machine(tiers, paths, cpu_adam_s_per_byte=1 / 40e9, gpu_adam_s_per_byte=1 / 40e9,
                      cpu_adam8_s_per_byte=1 / 25e9, gpu_adam8_s_per_byte=1 / 25e9, nvme_swaps_block=True,
                      nvme_state_takes_grads=True)
    return PlanProblem(layers, machine, workspace, **options)


def brute_force(problem: PlanProblem):
    best = None
    per_layer = [list(itertools.product(activation_options(problem, i), placement_options(problem, i)))
                 for i in range(problem.num_layers)]
    for combination in itertools.product(*per_layer):
        plan = evaluate_layers(problem, [LayerPlan.of(*choice) for choice in combination], "greedy")
        try:
            check_within_budgets(problem, plan)
        except BudgetExceeded:
            continue
        best = plan if best is None or plan.objective < best.objective else best
    return best


# About 5 s an instance: one of each kind (no parameter swap, a tight budget, parameters swapped) is
# in the default suite, the rest are slow.
RUNTIME_INSTANCES = [(0, 0.5, 0), (3, 0.4, 0), (1, 0.6, GB // 5),
                     *(pytest.param(*instance, marks=pytest.mark.slow)
                       for instance in [(0, 0.6, 0), (1, 0.6, 0), (3, 0.5, 0), (3, 0.45, GB // 10)])]


@pytest.mark.parametrize("seed,gpu_fraction,param_swap", RUNTIME_INSTANCES)
def test_milp_and_simulator_agree_on_the_runtime_terms(seed, gpu_fraction, param_swap):
    problem = runtime_problem(seed, 3, gpu_fraction, param_swap_bytes=param_swap)
    expected = brute_force(problem)
    assert expected is not None, "the instance must have a plan"
    plan = solve(problem, max_gap=0.0)
    assert plan.status == "optimal"
    assert plan.objective == pytest.approx(expected.objective, rel=TOLERANCES["planner_objective"])
    simulation = check_within_budgets(problem, plan)
    assert simulation.step_s == pytest.approx(plan.predicted_step_s, rel=TOLERANCES["planner_step_time"])
    for tier, peak in simulation.peak_bytes.items():
        assert peak == pytest.approx(plan.predicted_peak_bytes[tier], rel=TOLERANCES["planner_step_time"], abs=1), tier
    # The greedy plan is a heuristic (its moves only go down, and staging a state for NVMe can cost
    # more at the step than the state itself): where it finds a plan, the plan fits.
    try:
        greedy = greedy_plan(problem)
    except PlanInfeasible:
        return
    check_within_budgets(problem, greedy)


def test_the_instances_exercise_the_runtime_terms():
    """The instances above are not trivial: their optima put states and parameters on NVMe (whose
    swaps then block) or store activations at fewer bits (which then costs packing time)."""
    offloading = solve(runtime_problem(3, 3, 0.4), max_gap=0.0)
    assert all(lp.state_tier == "nvme" and lp.param_tier == "nvme" for lp in offloading.layers)
    quantizing = solve(runtime_problem(0, 3, 0.6), max_gap=0.0)
    assert any(lp.act_bits < 16 for lp in quantizing.layers)


def test_the_parameter_swapper_is_held_once_any_parameter_is_on_nvme():
    problem = runtime_problem(3, 3, 0.4)
    layers = solve(problem, max_gap=0.0).layers
    assert any(lp.param_tier == "nvme" for lp in layers)
    held = dataclasses.replace(problem, param_swap_bytes=GB // 10)
    with_swap = evaluate_layers(held, layers, "greedy")
    without = evaluate_layers(problem, layers, "greedy")
    assert with_swap.predicted_peak_bytes["gpu"] == pytest.approx(without.predicted_peak_bytes["gpu"] + GB // 10)
    in_memory = [dataclasses.replace(lp, param_tier="gpu") for lp in layers]
    assert evaluate_layers(held, in_memory, "greedy").predicted_peak_bytes == \
        evaluate_layers(problem, in_memory, "greedy").predicted_peak_bytes


def one_layer_problem(**machine_options) -> PlanProblem:
    layer = LayerCosts("l0", fwd_s=1.0, bwd_s=2.0, act_bytes={16: 100, 8: 50, 4: 25}, input_bytes=10,
                       param_bytes=20, grad_bytes=40, optim_state_bytes_fp32=120, optim_state_bytes_8bit=60,
                       quality_cost={16: 0.0, 8: 0.1, 4: 0.2}, pack_fwd_s={16: 0.0, 8: 0.25, 4: 0.5},
                       pack_bwd_s={16: 0.0, 8: 0.5, 4: 1.0}, recompute_s=0.75, stage_bytes_8bit=90)
    tiers = {"gpu": Tier("gpu", 10**6), "nvme": Tier("nvme", 10**6)}
    paths = {"nvme_write": Path("nvme_write", 10.0), "nvme_read": Path("nvme_read", 20.0)}
    machine = Machine(tiers, paths, cpu_adam_s_per_byte=0.01, gpu_adam_s_per_byte=0.02, cpu_adam8_s_per_byte=0.005,
                      gpu_adam8_s_per_byte=0.004, **machine_options)
    return PlanProblem([layer], machine, workspace_bytes=1000)


def test_simulated_windows_follow_the_rules_by_hand():
    """One layer, windows f0, b0, opt; its state 8-bit on NVMe, parameters in memory, kept at 4 bits."""
    problem = one_layer_problem(nvme_swaps_block=True, nvme_state_takes_grads=True)
    plan = evaluate_layers(problem, [LayerPlan("keep", 4, "gpu", "gpu", "nvme", True)], "greedy")
    windows = simulate(problem, plan).windows
    # f0: forward + quantizing; b0: backward + restoring; nothing moves before the optimizer window.
    assert [w.compute_s for w in windows[:2]] == [1.0 + 0.5, 2.0 + 1.0]
    # opt: the 8-bit step of an offloaded state (0.005 s/B x 60 B) plus the blocking swaps: state
    # read 60 B at 20 B/s and written at 10 B/s, the gradients written after backward (this is the
    # window after layer 0's backward) and read back: 3 + 6 + 4 + 2 seconds.
    assert windows[2].compute_s == pytest.approx(0.3 + 3 + 6 + 4 + 2)
    # Memory: workspace 1000 + params 20 + kept activations 25; gradients 40 from the backward on,
    # still there in the optimizer window (it copies them); the swapper stages 90 B to step.
    assert [w.memory["gpu"] for w in windows] == [1045, 1085, 1020 + 40 + 90]
    assert windows[2].memory["nvme"] == 60


def test_gradients_stepped_from_host_memory_cost_no_nvme_copies():
    """The planner's stage-3 optimizer steps a layer whose state is on NVMe from its gradients in host
    memory (Machine.nvme_grads_resident, plan/deepspeed/resident_gradients.py): the optimizer window of the test
    above loses the gradients' write and read (4 + 2 s) and keeps the rest; memory is unchanged."""
    layer = [LayerPlan("keep", 4, "gpu", "gpu", "nvme", True)]
    problems = [one_layer_problem(nvme_swaps_block=True, nvme_state_takes_grads=True, nvme_grads_resident=resident)
                for resident in (False, True)]
    written, resident = (simulate(problem, evaluate_layers(problem, layer, "greedy")).windows for problem in problems)
    assert written[2].compute_s == pytest.approx(0.3 + 3 + 6 + 4 + 2)
    assert resident[2].compute_s == pytest.approx(0.3 + 3 + 6)
    assert [w.memory for w in resident] == [w.memory for w in written]


def test_offloaded_activations_cost_their_measured_work():
    problem = two_layer_problem()
    plan = evaluate_layers(problem, [LayerPlan("keep", 8, "nvme", "gpu", "gpu", True),
                                     LayerPlan("keep", 16, "gpu", "gpu", "gpu", True)], "greedy")
    windows = simulate(problem, plan).windows
    # f0: forward 1 + packing at 8 bits 0.25 + offload work 0.125; b0 (the last window before opt):
    # backward 2 + restoring 0.5 + offload work 0.25.
    assert windows[0].compute_s == pytest.approx(1.375) and windows[3].compute_s == pytest.approx(2.75)


def two_layer_problem() -> PlanProblem:
    one = one_layer_problem()
    layer = dataclasses.replace(one.layers[0], offload_fwd_s={16: 0.25, 8: 0.125, 4: 0.0625},
                                offload_bwd_s={16: 0.5, 8: 0.25, 4: 0.125})
    return PlanProblem([layer, dataclasses.replace(layer, name="l1")], one.machine, one.workspace_bytes)


def test_without_blocking_swaps_only_exposed_time_counts():
    problem = one_layer_problem()
    plan = evaluate_layers(problem, [LayerPlan("recompute", 16, "gpu", "gpu", "nvme", True)], "greedy")
    windows = simulate(problem, plan).windows
    assert windows[1].compute_s == 2.0 + 0.75  # the measured recompute, not the forward
    # No blocking: the optimizer window's compute is the 8-bit step on the host rate (state off the
    # device); the copies (state only: gradients stay, nvme_state_takes_grads is off) overlap it.
    assert windows[2].compute_s == pytest.approx(0.3)
    assert windows[2].exposed_s == pytest.approx(6 - 0.3)


def test_fixed_placements_and_parameter_tiers_restrict_the_options():
    problem = one_layer_problem()
    fixed = PlanProblem(problem.layers, problem.machine, problem.workspace_bytes,
                        fixed_placements=(Placement("gpu", "nvme", True),))
    assert placement_options(fixed, 0) == [Placement("gpu", "nvme", True)]
    no_nvme_params = PlanProblem(problem.layers, problem.machine, problem.workspace_bytes, param_tiers=("gpu",))
    assert {p.param_tier for p in placement_options(no_nvme_params, 0)} == {"gpu"}
    assert {p.state_tier for p in placement_options(no_nvme_params, 0)} == {"gpu", "nvme"}
    with pytest.raises(ValueError, match="fixed_placements"):
        PlanProblem(problem.layers, problem.machine, problem.workspace_bytes, fixed_placements=())


def test_8bit_state_is_offered_beside_fp32_only_where_it_is_slower():
    problem = one_layer_problem()
    # 8-bit: 60 B at 0.004 s/B on the device (0.24 s) against fp32 120 B at 0.02 (2.4 s): dominated.
    assert {p.state_8bit for p in placement_options(problem, 0) if p.state_tier == "gpu"} == {True}
    slow = PlanProblem(problem.layers, Machine(problem.machine.tiers, problem.machine.paths, 0.01, 0.02,
                                               cpu_adam8_s_per_byte=0.05), problem.workspace_bytes)
    # Offloaded: 8-bit 60 B at 0.05 (3 s) against fp32 120 B at 0.01 (1.2 s): both are offered.
    assert {p.state_8bit for p in placement_options(slow, 0) if p.state_tier == "nvme"} == {True, False}
