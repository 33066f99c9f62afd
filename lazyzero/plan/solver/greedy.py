"""A feasible plan by rules: the MILP's warm start and its feasibility oracle (docs/plan.md).

Start with everything on the device at the widest width each layer may use. While the simulator
reports a tier over its budget, apply the single-layer move that frees bytes on that tier at the
lowest estimated cost per byte: narrower activations (among the layer's widths), recompute,
offloaded activations, offloaded optimizer state, offloaded parameters. The optimizer state is 8-bit
from the start where allowed (placement_options explains why). Moves only go "down" (narrower,
slower tiers), so the loop ends. Under `offload_all_or_none` a kind (parameters, optimizer states)
leaves the device in every layer at once.

The cost estimate is pessimistic (every copy counted as exposed) and the bytes freed ignore which
window holds the peak; the simulator, not the estimate, decides when the plan fits.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from lazyzero.plan.solver.problem import (
    RECOMPUTE,
    LayerPlan,
    Placement,
    Plan,
    PlanInfeasible,
    PlanProblem,
    blocking_seconds,
    optimizer_step_s,
    placement_options,
    placement_traffic,
    widest_activation,
)
from lazyzero.plan.solver.simulate import evaluate_layers

# Tiers in the order data is pushed away from the device.
_TIER_ORDER = ("gpu", "cpu", "nvme")


def greedy_plan(problem: PlanProblem) -> Plan:
    layers = [_widest(problem, i) for i in range(problem.num_layers)]
    while True:
        plan = evaluate_layers(problem, layers, "greedy")
        over = [t for t, used in plan.predicted_peak_bytes.items() if used > _capacity(problem, t)]
        if not over:
            return plan
        move = _best_move(problem, layers, over[0], plan.predicted_peak_bytes)
        if move is None:
            raise PlanInfeasible(f"greedy: no move frees {over[0]} memory; still over budget in "
                                 f"{over} (peaks {plan.predicted_peak_bytes})", tuple(over))
        for i, lp in move.items():
            layers[i] = lp


def _widest(problem: PlanProblem, i: int) -> LayerPlan:
    """Everything on the device at the widest width the layer may use (recomputed if none; 8-bit
    state where it is no larger), or on the first tier parameters may use; a fixed placement as it is."""
    first = placement_options(problem, i)[0]
    if _placement_fixed(problem, i):
        return LayerPlan.of(widest_activation(problem, i), first)
    return LayerPlan.of(widest_activation(problem, i), Placement(first.param_tier, "gpu", first.state_8bit))


def _placement_fixed(problem: PlanProblem, i: int) -> bool:
    return problem.fixed_placements is not None and problem.fixed_placements[i] is not None


def _capacity(problem: PlanProblem, tier: str) -> int:
    return problem.machine.tiers[tier].capacity_bytes


def _best_move(problem: PlanProblem, layers: list[LayerPlan], tier: str, peaks: dict):
    """{layer: new LayerPlan} freeing `tier` memory at the least cost per byte, or None."""
    best, best_rate = None, None
    for move in _candidate_moves(problem, layers):
        change, checked, extra_cost = defaultdict(float), set(), 0.0
        for i, candidate in move.items():
            before, after = _footprint(problem, i, layers[i]), _footprint(problem, i, candidate)
            for t in set(before) | set(after):
                change[t] += after.get(t, 0) - before.get(t, 0)
            checked.update(after)
            extra_cost += _cost(problem, i, candidate) - _cost(problem, i, layers[i])
        freed = -change[tier]
        fits = all(peaks.get(t, 0) + change[t] <= _capacity(problem, t) for t in checked if t != tier)
        if freed <= 0 or not fits:
            continue
        rate = extra_cost / freed
        if best_rate is None or rate < best_rate:
            best, best_rate = move, rate
    return best


def _candidate_moves(problem: PlanProblem, layers: list[LayerPlan]):
    """Every single-layer move, except that under offload_all_or_none a kind leaves the device only
    in every layer at once (one move), so that every plan keeps the rule."""
    for i, current in enumerate(layers):
        for candidate in _moves(problem, i, current):
            if not problem.offload_all_or_none or not _leaves_device(current, candidate):
                yield {i: candidate}
    if not problem.offload_all_or_none or any(_placement_fixed(problem, i) for i in range(len(layers))):
        return
    for attribute, below in (("param_tier", _param_tiers_below), ("state_tier", _lower_tiers)):
        targets = below(problem, "gpu")
        if targets and all(getattr(lp, attribute) == "gpu" for lp in layers):
            yield {i: replace(lp, **{attribute: targets[0]}) for i, lp in enumerate(layers)}


def _leaves_device(current: LayerPlan, candidate: LayerPlan) -> bool:
    return any(getattr(current, a) == "gpu" != getattr(candidate, a) for a in ("param_tier", "state_tier"))


def _lower_tiers(problem: PlanProblem, tier: str) -> list[str]:
    tiers = [t for t in _TIER_ORDER if t in problem.machine.tiers]
    return tiers[tiers.index(tier) + 1:]


def _moves(problem: PlanProblem, i: int, lp: LayerPlan) -> list[LayerPlan]:
    """Every one-step downward change of layer i's choices."""
    moves = []
    if lp.act_mode == "keep":
        narrower = [b for b in problem.layer_widths(i) if b < lp.act_bits]
        if narrower:
            moves.append(replace(lp, act_bits=max(narrower)))
        if problem.may_recompute(i):
            moves.append(LayerPlan.of(RECOMPUTE, lp.placement))
        if problem.activation_read_windows(i):
            moves += [replace(lp, act_tier=t) for t in _lower_tiers(problem, lp.act_tier)]
    if not _placement_fixed(problem, i):
        moves += [replace(lp, state_tier=t) for t in _lower_tiers(problem, lp.state_tier)]
        moves += [replace(lp, param_tier=t) for t in _param_tiers_below(problem, lp.param_tier)]
    return moves


def _param_tiers_below(problem: PlanProblem, tier: str) -> list[str]:
    return [t for t in _lower_tiers(problem, tier) if problem.param_tiers is None or t in problem.param_tiers]


def _footprint(problem: PlanProblem, i: int, lp: LayerPlan) -> dict[str, float]:
    """Bytes layer i keeps on each tier at the end of the forward pass (gradients where they go)."""
    costs, usage = problem.layers[i], {}

    def add(tier, size):
        usage[tier] = usage.get(tier, 0) + size

    add(lp.act_tier, costs.act_bytes[lp.act_bits] if lp.act_mode == "keep" else costs.input_bytes)
    add(lp.param_tier, costs.param_bytes)
    add(lp.state_tier, costs.state_bytes(lp.state_8bit))
    machine = problem.machine
    if machine.optimizer_on_host(lp.state_tier):
        add("cpu", costs.grad_bytes)
    elif not machine.grads_leave_device(lp.state_tier):  # else they go to NVMe with the state
        add("gpu", costs.grad_bytes)
    return usage


def _cost(problem: PlanProblem, i: int, lp: LayerPlan) -> float:
    """Estimated seconds per step of layer i's choices, every copy assumed exposed, plus quality."""
    costs, machine = problem.layers[i], problem.machine
    seconds = optimizer_step_s(problem, i, lp.placement)
    seconds += sum(blocking_seconds(problem, t) or t.bytes / machine.paths[t.path].bytes_per_s
                   for t in placement_traffic(problem, i, lp.placement))
    forward, backward = costs.window_seconds(lp.act)
    seconds += forward + backward - costs.fwd_s - costs.bwd_s
    if lp.act_mode == "recompute":
        return seconds
    if lp.offloaded:
        size = costs.act_bytes[lp.act_bits]
        route = machine.route_down(lp.act_tier) + machine.route_up(lp.act_tier)
        seconds += sum(size / machine.paths[p].bytes_per_s for p in route)
    return seconds + costs.quality_cost[lp.act_bits]

