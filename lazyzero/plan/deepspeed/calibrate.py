"""Planning problems corrected by measurements (docs/plan.md, "How it works" and "The calibration engines").

`engine_calibrated`, before a run: the profile's engine calibration (real engines of the model cut to
a few decoder layers, everything in memory, plan/profile/engine_calibration.py) against what the problem predicts
for the same engines. The difference between the shallowest and the deepest engines' errors, per
layer between them, is DeepSpeed's own cost per layer (module hooks, gathers, buckets, partition
copies), split 1:2 into each decoder layer's forward and backward; what remains of the shallowest
engine's error is its cost per step, added to the head's backward. The engines' memory above the
prediction is split the same way (`engine_memory_excess`): a fixed part moves the workspace, a part
per decoder layer is held by each layer whose parameters and optimizer state stay in compute memory.

`calibrated_problem`, during a run (re-planning): every compute time (layer forward, backward,
optimizer) is scaled by measured / predicted step time, and the compute memory's workspace moves by
measured - predicted peak. The placements of parameters and optimizer states are fixed to the
measured plan's: the running engine cannot move them, so the new plan may only change the
activation choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD
from lazyzero.plan.solver.problem import LayerPlan, Machine, Plan, PlanInfeasible, PlanProblem
from lazyzero.plan.solver.simulate import evaluate_layers


def engine_calibrated(problem: PlanProblem, profile, process_bytes: int) -> PlanProblem:
    """`problem` with DeepSpeed's own per-layer and per-step time, and its fixed memory, from
    `profile.engine` (engines of a few and of more decoder layers). `process_bytes`: the part of the
    problem's workspace that is the process itself, not the engine (the engines ran in processes of
    their own: their memory is compared without it)."""
    in_memory = sorted((run for run in profile.engine.runs if not run.nvme), key=lambda run: run.layers)
    depths = [run.layers for run in in_memory]
    if len(depths) < 2 or len(set(depths)) != len(depths):
        raise ValueError(f"engine calibration: needs engines of two or more distinct layer counts, the profile has "
                         f"{depths}")
    # The line through the shallowest and the deepest engine: a run has all its decoder layers, and
    # DeepSpeed's cost per layer grows with depth (engine_calibration.py), so the deepest is the nearest.
    runs = [in_memory[0], in_memory[-1]]
    errors = []
    for run in runs:
        step_s, peak = _in_memory_prediction(_cut(problem, run.layers))
        # The engine's memory: its peak above what the process held before it, plus the model it
        # was given, which ZeRO-3 freed while partitioning it (it was in `before_bytes`).
        engine_bytes = run.peak_bytes - run.before_bytes + run.model_bytes
        errors.append((run.step_s - step_s, engine_bytes - (peak - process_bytes)))
    (small_s, _), (large_s, _) = errors
    per_layer_s = (large_s - small_s) / (runs[1].layers - runs[0].layers)
    per_step_s = small_s - runs[0].layers * per_layer_s
    fixed, per_layer = engine_memory_excess((run.layers, error) for run, (_, error) in zip(runs, errors))
    layers = tuple(_with_overhead(c, per_layer_s, per_step_s, round(per_layer)) for c in problem.layers)
    problem = replace(problem, layers=layers, workspace_bytes=max(0, round(problem.workspace_bytes + fixed)))
    swapped = [run for run in profile.engine.runs if run.nvme and not run.params_only]
    if swapped and "nvme" in problem.machine.tiers:
        same_depth = next(run for run in in_memory if run.layers == swapped[0].layers)
        params_alone = next((run for run in profile.engine.runs if run.params_only), None)
        problem = nvme_calibrated(problem, same_depth.step_s, swapped[0], params_alone)
    return problem


def nvme_calibrated(problem: PlanProblem, in_memory_step_s: float, swapped, params_alone=None) -> PlanProblem:
    """`problem` (already engine-calibrated) with its NVMe reads and writes priced from the NVMe
    calibration engines (engine_calibration.py) of the depth of the in-memory one that took
    `in_memory_step_s`. Every NVMe copy is priced at the one speed at which `swapped` (parameters and
    optimizer state on NVMe, all at that speed) costs what it measured; `params_alone` (its decoder
    layers' parameters on NVMe, or None) then prices the parameters' own copies
    (`Machine.nvme_param_bytes_per_s`) at the speed that reproduces what it costs over memory. The
    states are not priced at what `swapped` leaves once `params_alone` is taken out: a difference of two
    differences of medians is noise, not a speed. Parameters being slower per byte, this prices state
    copies somewhat slow. One speed for both directions: the disk test's ratio of read to write does not
    follow the run's step. An engine measured no slower than the one it is compared with (noise) prices
    nothing: parameters then go at the other copies' speed, and those at the disk test's. Why each rule:
    docs/plan.md, "The calibration engines", and the records it links."""
    cut = _cut(problem, swapped.layers)
    in_memory_s = _in_memory_prediction(cut)[0]
    at_unit_speed = _with_nvme_speed(cut, UNIT_SPEED)
    speed = _fitted_speed(at_unit_speed, in_memory_s, swapped.step_s - in_memory_step_s)
    if speed is not None:
        problem = _with_nvme_speed(problem, speed)
    if params_alone is not None:
        param_speed = _fitted_speed(at_unit_speed, in_memory_s, params_alone.step_s - in_memory_step_s, states=False)
        if param_speed is not None:
            problem = _with_param_speed(problem, param_speed)
    return problem


def _fitted_speed(at_unit_speed: PlanProblem, in_memory_s: float, measured_s: float, states: bool = True):
    """The path speed (bytes per second) at which the swapped engine's predicted excess over
    `in_memory_s` is `measured_s`, from its prediction with every NVMe path at UNIT_SPEED
    (`at_unit_speed`); copies priced apart (parameters at their own speed) keep their price. None where
    the excess at UNIT_SPEED or the measured one is not positive. NVMe swaps block
    (`Machine.nvme_swaps_block`), so the excess is linear in each speed's inverse."""
    at_unit_s = _swapped_prediction(at_unit_speed, states) - in_memory_s
    apart_s = _swapped_prediction(_with_nvme_speed(at_unit_speed, math.inf), states) - in_memory_s
    if at_unit_s - apart_s <= 0 or measured_s - apart_s <= 0:
        return None
    return UNIT_SPEED * (at_unit_s - apart_s) / (measured_s - apart_s)


# Bytes per second at which the NVMe engine's traffic is counted before its measured time scales it.
UNIT_SPEED = 1e9


def _with_nvme_speed(problem: PlanProblem, bytes_per_s: float) -> PlanProblem:
    paths = {name: replace(path, bytes_per_s=bytes_per_s) if name.startswith("nvme") else path
             for name, path in problem.machine.paths.items()}
    return replace(problem, machine=replace(problem.machine, paths=paths))


def _with_param_speed(problem: PlanProblem, bytes_per_s: float) -> PlanProblem:
    return replace(problem, machine=replace(problem.machine, nvme_param_bytes_per_s=bytes_per_s))


def _swapped_prediction(problem: PlanProblem, states: bool = True) -> float:
    """Predicted step time of an NVMe calibration engine: each decoder layer's parameters on NVMe where
    the problem allows parameters there, and (with `states`) its fp32 optimizer state; the embeddings
    and head in memory."""
    param_tier = "nvme" if problem.param_tiers is None or "nvme" in problem.param_tiers else "gpu"
    state_tier = "nvme" if states else "gpu"
    layers = [LayerPlan("keep", 16, "gpu", "gpu", "gpu", False) if c.name == EMBED_AND_HEAD
              else LayerPlan("keep", 16, "gpu", param_tier, state_tier, False) for c in problem.layers]
    return evaluate_layers(problem, layers, "greedy").predicted_step_s


def engine_memory_excess(errors) -> tuple[float, float]:
    """(fixed, per decoder layer) bytes an engine holds beyond the formulas, from `errors`:
    (decoder layers, measured - predicted engine bytes) of the two calibration engines.

    What an engine holds beyond the formulas grows with its depth (DeepSpeed's and the allocator's
    memory per layer), so the line through the two errors is split into its value at 0 layers (the
    workspace's) and its slope, which each decoder layer holds while its parameters and optimizer state
    are in compute memory (`LayerCosts.engine_excess_held`): the calibration engines hold every layer in
    memory, and a layer with either elsewhere holds none of it (docs/plan.md, "The calibration
    engines"). A line that falls with depth is noise, not memory an engine gives back: the larger
    measured error is then fixed. Never below 0: an engine's peak is measured above
    the resident set its process had before it was built, which includes heap the process had freed
    and the engine then reuses (the import of transformers, the model's creation), so a measured
    engine can look smaller than it is, never larger."""
    (small_layers, small), (large_layers, large) = sorted(errors)
    per_layer = (large - small) / (large_layers - small_layers)
    if per_layer <= 0:
        return max(0.0, small, large), 0.0
    return max(0.0, small - per_layer * small_layers), per_layer


def _cut(problem: PlanProblem, decoder_layers: int) -> PlanProblem:
    """The problem of the same model with only its first `decoder_layers` decoder layers."""
    kept = [c for c in problem.layers if c.name != EMBED_AND_HEAD][:decoder_layers]
    return replace(problem, layers=tuple(kept + [c for c in problem.layers if c.name == EMBED_AND_HEAD]),
                   fixed_placements=None)


def _in_memory_prediction(problem: PlanProblem) -> tuple[float, float]:
    """Predicted step time and compute-memory peak of the calibration engines: every tensor in
    memory, fp32 optimizer states, activations kept at 16 bits (the user's optimizer)."""
    plan = evaluate_layers(problem, [LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)] * problem.num_layers, "greedy")
    return plan.predicted_step_s, plan.predicted_peak_bytes["gpu"]


def _with_overhead(costs, per_layer_s: float, per_step_s: float, excess_bytes: int):
    if costs.name == EMBED_AND_HEAD:
        return replace(costs, bwd_s=max(0.0, costs.bwd_s + per_step_s))
    return replace(costs, fwd_s=max(0.0, costs.fwd_s + per_layer_s / 3),
                   bwd_s=max(0.0, costs.bwd_s + 2 * per_layer_s / 3), engine_excess_bytes=excess_bytes)


def predicted_compute_peak(problem: PlanProblem, plan: Plan, snapshot_taken: bool = True) -> float:
    """The plan's predicted peak of the compute memory over steps measured before the first lazy
    checkpoint (`snapshot_taken` False: its snapshot memory is not held yet) or after it (the
    plan's own peak, the larger one)."""
    peak = plan.predicted_peak_bytes["gpu"]
    if snapshot_taken or problem.host_tier() != "gpu":
        return peak
    return peak - problem.snapshot_held(plan.layers)


def calibrated_problem(problem: PlanProblem, plan: Plan, measured_step_s: float,
                       measured_peak_bytes: float, snapshot_taken: bool = True) -> PlanProblem:
    """The problem a re-plan solves: `problem` at the measured speed and memory, with `plan`'s
    placements fixed (a built engine cannot move them) and its activation widths kept (a re-plan
    moves activations between memory, NVMe and recompute without changing what is computed).
    `snapshot_taken`: whether a lazy checkpoint's snapshot memory was held while the peak was
    measured (it is predicted from the plan either way, so only the rest moves the workspace)."""
    if measured_step_s <= 0 or plan.predicted_step_s <= 0:
        raise ValueError(f"step times must be > 0, got measured {measured_step_s!r}, "
                         f"predicted {plan.predicted_step_s!r}")
    speed = measured_step_s / plan.predicted_step_s
    layers = tuple(replace(c, fwd_s=c.fwd_s * speed, bwd_s=c.bwd_s * speed,
                           quality_cost={bits: cost * speed for bits, cost in c.quality_cost.items()})
                   for c in problem.layers)
    machine: Machine = replace(problem.machine, cpu_adam_s_per_byte=problem.machine.cpu_adam_s_per_byte * speed,
                               gpu_adam_s_per_byte=problem.machine.gpu_adam_s_per_byte * speed)
    predicted_peak = predicted_compute_peak(problem, plan, snapshot_taken)
    workspace = max(0, round(problem.workspace_bytes + measured_peak_bytes - predicted_peak))
    return replace(problem, layers=layers, machine=machine, workspace_bytes=workspace,
                   fixed_placements=tuple(lp.placement for lp in plan.layers),
                   fixed_act_bits=tuple(lp.act_bits for lp in plan.layers))


def with_free_widths(problem: PlanProblem) -> PlanProblem:
    """`problem` with its activation widths free again (a re-plan that cannot keep them within the
    budget may change them, and with them the run's losses)."""
    return replace(problem, fixed_act_bits=None)


# How far above its budget a re-plan may let the compute memory go, in steps of the budget, when
# the measured memory leaves no plan within it (the run goes on with the least excess it can get).
EXCESS_STEP, MAX_EXCESS = 0.025, 0.5


def with_compute_capacity(problem: PlanProblem, capacity: float) -> PlanProblem:
    tiers = {**problem.machine.tiers, "gpu": replace(problem.machine.tiers["gpu"], capacity_bytes=round(capacity))}
    return replace(problem, machine=replace(problem.machine, tiers=tiers))


def smallest_compute_budget(problem: PlanProblem, *, low: float | None = None, high: float | None = None,
                            rounds: int = 8, time_limit_s: float = 2.0) -> int | None:
    """About the least compute-memory capacity (bytes, within (high - low) / 2**rounds) at which
    `problem` has a plan, by bisection between `low` (default: its own capacity, taken to have none)
    and `high` (default: four times that); None when even `high` has none. For error messages (how
    much memory a run that cannot start would need) and for choosing test budgets."""
    from lazyzero.plan.solver.milp import SolverFoundNoPlan, solve

    def feasible(capacity: float) -> bool:
        try:
            solve(with_compute_capacity(problem, capacity), time_limit_s=time_limit_s, max_gap=1.0)
            return True
        except (PlanInfeasible, SolverFoundNoPlan):
            return False

    capacity = problem.machine.tiers["gpu"].capacity_bytes
    low = float(capacity if low is None else low)
    high = float(4 * capacity if high is None else high)
    if not feasible(high):
        return None
    for _ in range(rounds):
        middle = (low + high) / 2
        low, high = (low, middle) if feasible(middle) else (middle, high)
    return round(high)


def solve_with_least_excess(problem: PlanProblem, time_limit_s: float, max_gap: float) -> tuple[Plan, float]:
    """The best plan within the budgets or, when measurements left none, within the smallest
    compute-memory budget (in steps of `EXCESS_STEP` over the given one) that admits one; returns
    the plan and that excess (0.0: within the budget). Re-raises PlanInfeasible beyond `MAX_EXCESS`."""
    from lazyzero.plan.solver.milp import solve

    capacity = problem.machine.tiers["gpu"].capacity_bytes
    steps = round(MAX_EXCESS / EXCESS_STEP)
    for step in range(steps + 1):
        excess = step * EXCESS_STEP
        try:
            return solve(with_compute_capacity(problem, capacity * (1 + excess)),
                         time_limit_s=time_limit_s, max_gap=max_gap), excess
        except PlanInfeasible as error:
            if "gpu" not in error.tiers or step == steps:
                raise
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class HeadroomBudget:
    """A compute-memory capacity placed between the least that admits a plan and the all-in-memory
    plan's peak (planning capacities: after `memory_reserve`)."""

    share: float
    least_bytes: int
    in_memory_bytes: int

    @property
    def capacity_bytes(self) -> int:
        return round(self.least_bytes + self.share * (self.in_memory_bytes - self.least_bytes))


def all_in_memory_peak(problem: PlanProblem) -> int:
    """The compute-memory peak of the plan that keeps every tensor in memory, at 16 bits, fp32 states."""
    keep = [LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)] * problem.num_layers
    return round(evaluate_layers(problem, keep, "greedy").predicted_peak_bytes["gpu"])


def headroom_budget(problem: PlanProblem, share: float) -> HeadroomBudget:
    """`share` of the way from the least compute-memory capacity that admits a plan of `problem` to
    the all-in-memory plan's peak. Both move with everything the profile measured (the process, the
    libraries it loaded), so a budget given this way holds on any machine and torch build."""
    in_memory = all_in_memory_peak(problem)
    least = smallest_compute_budget(problem, low=0, high=in_memory, rounds=12)
    if least is None:
        raise PlanInfeasible(f"lazyzero.plan.headroom_share: no plan fits even the all-in-memory peak "
                             f"({in_memory / 1e9:.2f} GB per rank); another tier's budget (cpu_mem, nvme_path) "
                             "is too small", ("gpu",))
    return HeadroomBudget(share, min(least, in_memory), in_memory)
