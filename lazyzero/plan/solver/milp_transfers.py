"""Activation copies in the planner's MILP (docs/plan.md): bytes per window summed over layers, and the
per-layer schedule they split back into.

Why one variable per window rather than one per layer and window (the 80-layer instance has 2 x 80
windows x 80 layers): which layer a byte belongs to never enters a capacity or bandwidth row, only
how many bytes a path carries in a window. Layer i's activations may go down (to their tier) in any
window from its own forward (window i) to the last forward, and come up in any window from the first
backward to backward_window(i + 1), the one before its own backward. So "down" is an inventory:
with backlog[i] the bytes of layers before i still to write when window i starts,

    down[i] = kept[i] + backlog[i] - backlog[i + 1],   backlog[0] = backlog[n] = 0,

and "up" is its mirror in time: with read_ahead[i] the bytes of layers before i already read when
up[i]'s window (backward_window(i + 1), the last for layer i) ends,

    up[i] = kept[i] + read_ahead[i] - read_ahead[i + 1],   read_ahead[0] = read_ahead[n - 1] = 0.

Every per-layer schedule sums to such flows (backlog and read_ahead are then >= 0), and flows with
non-negative backlog and read_ahead split back into a per-layer schedule in allowed windows
(`per_layer_transfers`), so the optimum does not change; the model has about 4n variables and rows
per tier instead of n^2.
"""

from __future__ import annotations

from collections import defaultdict

import mip

from lazyzero.plan.solver.problem import ActTransfer, LayerPlan, PlanProblem

# The MILP's unit of bytes (milp.py: it keeps coefficients within a few orders of the seconds).
GB = 1e9


def add_activation_flows(problem: PlanProblem, model: mip.Model, kept: dict[str, list]) -> dict:
    """kept[tier][i]: GB that layer i's chosen option stores on `tier` (an expression, 0 unless it
    offloads there). Adds the flow rows ("act_down[i,tier]", "act_up[i,tier]") and returns
    {(direction, tier): {i: GB variable}}, flow i running in flow_window(problem, direction, i)."""
    n, flows = problem.num_layers, {}
    for tier, stored in kept.items():
        backlog = [0] + [model.add_var(f"down_backlog[{tier},{i}]") for i in range(1, n)] + [0]
        ahead = [0] + [model.add_var(f"read_ahead[{tier},{i}]") for i in range(1, n - 1)] + [0]
        down = flows["down", tier] = {i: model.add_var(f"down[{tier},{i}]") for i in range(n)}
        up = flows["up", tier] = {i: model.add_var(f"up[{tier},{i}]") for i in range(n - 1)}
        for i in range(n):
            model.add_constr(down[i] == stored[i] + backlog[i] - backlog[i + 1], name=f"act_down[{i},{tier}]")
        for i in range(n - 1):
            model.add_constr(up[i] == stored[i] + ahead[i] - ahead[i + 1], name=f"act_up[{i},{tier}]")
    return flows


def flow_window(problem: PlanProblem, direction: str, i: int) -> int:
    """The window of flow i: the forward of layer i (down), the backward of layer i + 1 (up)."""
    return problem.forward_window(i) if direction == "down" else problem.backward_window(i + 1)


def per_layer_transfers(problem: PlanProblem, flows: dict, layers: tuple[LayerPlan, ...]) -> list[ActTransfer]:
    """Split each solved window flow among the layers it may carry: down, the oldest waiting layer
    first (all share the last forward as deadline, so any order meets it); up, the layer due soonest
    first (earliest deadline first meets every deadline whenever the flows do). Each layer's amounts
    are then scaled to its exact size, as CBC meets the flow rows only to its tolerance."""
    transfers = []
    for (direction, tier), window_flows in flows.items():
        left = {i: problem.layers[i].act_bytes[lp.act_bits] for i, lp in enumerate(layers)
                if lp.offloaded and lp.act_tier == tier}
        moved = defaultdict(dict)
        # Down: flow k may carry layers i <= k (released); up: also i <= k (not yet due).
        order = sorted(window_flows) if direction == "down" else sorted(window_flows, reverse=True)
        for k in order:
            budget = max(window_flows[k].x, 0.0) * GB
            waiting = [i for i in left if i <= k]
            for i in (waiting if direction == "down" else reversed(waiting)):
                amount = min(budget, left[i])
                if amount > 0:
                    moved[i][flow_window(problem, direction, k)] = amount
                    left[i] -= amount
                    budget -= amount
        for i, amounts in moved.items():
            size, total = problem.layers[i].act_bytes[layers[i].act_bits], sum(amounts.values())
            transfers += [ActTransfer(i, direction, w, size * b / total) for w, b in amounts.items()]
    return transfers
