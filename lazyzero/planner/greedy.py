"""A feasible plan by rules: the MILP's warm start and its feasibility oracle (issue 7).

Start with everything on the device at the widest allowed width. While the simulator reports a tier
over its budget, apply the single-layer move that frees bytes on that tier at the lowest estimated
cost per byte: narrower activations, recompute, offloaded activations, offloaded optimizer state,
offloaded parameters. The optimizer state is 8-bit from the start where allowed (placement_options
explains why). Moves only go "down" (narrower, slower tiers), so the loop ends.

The cost estimate is pessimistic (every copy counted as exposed) and the bytes freed ignore which
window holds the peak; the simulator, not the estimate, decides when the plan fits.
"""

from __future__ import annotations

from dataclasses import replace

from lazyzero.planner.problem import (RECOMPUTE, LayerPlan, Plan, PlanInfeasible, PlanProblem, optimizer_step_s,
                                      placement_options, placement_traffic)
from lazyzero.planner.simulate import evaluate_layers

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
        layers[move[0]] = move[1]


def _widest(problem: PlanProblem, i: int) -> LayerPlan:
    """Everything on the device at the widest allowed width (8-bit state where it is no larger)."""
    eight_bit = placement_options(problem, i)[0].state_8bit
    return LayerPlan("keep", max(problem.allowed_bits), "gpu", "gpu", "gpu", eight_bit)


def _capacity(problem: PlanProblem, tier: str) -> int:
    return problem.machine.tiers[tier].capacity_bytes


def _best_move(problem: PlanProblem, layers: list[LayerPlan], tier: str, peaks: dict):
    """(layer, new LayerPlan) freeing `tier` memory at the least cost per byte, or None."""
    best, best_rate = None, None
    for i, current in enumerate(layers):
        before = _footprint(problem, i, current)
        for candidate in _moves(problem, i, current):
            after = _footprint(problem, i, candidate)
            freed = before.get(tier, 0) - after.get(tier, 0)
            fits = all(peaks.get(t, 0) + after.get(t, 0) - before.get(t, 0) <= _capacity(problem, t)
                       for t in after if t != tier)
            if freed <= 0 or not fits:
                continue
            rate = (_cost(problem, i, candidate) - _cost(problem, i, current)) / freed
            if best_rate is None or rate < best_rate:
                best, best_rate = (i, candidate), rate
    return best


def _moves(problem: PlanProblem, i: int, lp: LayerPlan) -> list[LayerPlan]:
    """Every one-step downward change of layer i's choices."""
    tiers = [t for t in _TIER_ORDER if t in problem.machine.tiers]

    def lower(tier: str) -> list[str]:
        return tiers[tiers.index(tier) + 1:]

    moves = []
    if lp.act_mode == "keep":
        narrower = [b for b in problem.allowed_bits if b < lp.act_bits]
        if narrower:
            moves.append(replace(lp, act_bits=max(narrower)))
        if problem.allow_recompute:
            moves.append(LayerPlan.of(RECOMPUTE, lp.placement))
        if problem.activation_read_windows(i):
            moves += [replace(lp, act_tier=t) for t in lower(lp.act_tier)]
    moves += [replace(lp, state_tier=t) for t in lower(lp.state_tier)]
    moves += [replace(lp, param_tier=t) for t in lower(lp.param_tier)]
    return moves


def _footprint(problem: PlanProblem, i: int, lp: LayerPlan) -> dict[str, float]:
    """Bytes layer i keeps on each tier at the end of the forward pass (gradients where they go)."""
    costs, usage = problem.layers[i], {}

    def add(tier, size):
        usage[tier] = usage.get(tier, 0) + size

    add(lp.act_tier, costs.act_bytes[lp.act_bits] if lp.act_mode == "keep" else costs.input_bytes)
    add(lp.param_tier, costs.param_bytes)
    add(lp.state_tier, costs.state_bytes(lp.state_8bit))
    add("cpu" if problem.machine.optimizer_on_host(lp.state_tier) else "gpu", costs.grad_bytes)
    return usage


def _cost(problem: PlanProblem, i: int, lp: LayerPlan) -> float:
    """Estimated seconds per step of layer i's choices, every copy assumed exposed, plus quality."""
    costs, machine = problem.layers[i], problem.machine
    seconds = optimizer_step_s(problem, i, lp.placement)
    seconds += sum(t.bytes / machine.paths[t.path].bytes_per_s for t in placement_traffic(problem, i, lp.placement))
    if lp.act_mode == "recompute":
        return seconds + costs.fwd_s
    if lp.offloaded:
        size = costs.act_bytes[lp.act_bits]
        route = machine.route_down(lp.act_tier) + machine.route_up(lp.act_tier)
        seconds += sum(size / machine.paths[p].bytes_per_s for p in route)
    return seconds + costs.quality_cost[lp.act_bits]

