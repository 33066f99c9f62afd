"""Step simulator: replays a plan window by window, adding and removing bytes on each tier.

Written independently of the MILP's formulas (`milp.py` sums closed-form expressions; this walks the
step), so a modelling error in one shows up as a disagreement with the other. It uses the plan's own
transfer schedule (the MILP's, or `default_schedule` for rule-based plans) and checks that the
schedule moves every offloaded activation and the checkpoint snapshot in full, in allowed windows,
that the plan keeps the problem's offload_all_or_none rule and that no layer keeps its activations at
a width its gradient error bound excludes (a ValueError otherwise).

Memory rules walked here (see problem.py for the windows):
- device: workspace, parameters/states placed on it, 2x the largest offloaded parameter and 2x the
  largest offloaded activation (double buffers, whenever any is offloaded), kept activations (or the
  input of a recomputed layer) from their forward until their backward, a recomputed layer's 16-bit
  activations during its backward, gradients from their backward on; a gradient bound for a host
  optimizer is counted on both sides in the window that copies it, then only on the host.
- host/NVMe: parameters and states placed there, activations from their forward until their backward.
- NVMe-resident optimizer state is stepped one layer at a time: the largest such layer's state is
  staged in the optimizer's memory (host, or device without one) during the optimizer window.
- lazy checkpoints: the snapshot's host buffers and staging blocks (`PlanProblem.snapshot_held`), in
  every window of the host memory, as after the first checkpoint.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from lazyzero.plan.solver.problem import (
    ActTransfer,
    LayerPlan,
    Plan,
    PlanProblem,
    blocking_seconds,
    check_act_widths,
    check_offload_all_or_none,
    optimizer_step_s,
    placement_traffic,
    quality_cost,
)

# Relative slack when checking that a schedule moves exactly what it must (solver round-off).
SCHEDULE_RTOL = 1e-6


class BudgetExceeded(ValueError):
    """A plan overflows `tier` in window `window` (its label, e.g. "b3")."""

    def __init__(self, tier: str, window: str, used: float, capacity: float):
        super().__init__(f"{tier} budget exceeded in window {window}: {used:.0f} bytes used, capacity {capacity}")
        self.tier, self.window = tier, window


@dataclass(frozen=True)
class WindowRecord:
    label: str
    compute_s: float
    transfer_s: dict[str, float]
    exposed_s: float
    memory: dict[str, float]


@dataclass(frozen=True)
class StepSimulation:
    windows: tuple[WindowRecord, ...]
    peak_bytes: dict[str, float]
    step_s: float


def window_label(problem: PlanProblem, window: int) -> str:
    if window == problem.optimizer_window:
        return "opt"
    if window < problem.num_layers:
        return f"f{window}"
    return f"b{2 * problem.num_layers - 1 - window}"


def simulate(problem: PlanProblem, plan: Plan) -> StepSimulation:
    check_offload_all_or_none(problem, plan.layers)
    check_act_widths(problem, plan.layers)
    _check_schedule(problem, plan)
    compute = _compute_seconds(problem, plan.layers)
    loads = _path_loads(problem, plan)
    memory = _walk_memory(problem, plan.layers)
    records = []
    for window in range(problem.num_windows):
        transfer_s = {p: b / problem.machine.paths[p].bytes_per_s for p, b in loads[window].items()}
        exposed = max([0.0] + [t - compute[window] for t in transfer_s.values()])
        records.append(WindowRecord(window_label(problem, window), compute[window], transfer_s, exposed,
                                    memory[window]))
    peak = {tier: max(r.memory.get(tier, 0.0) for r in records) for tier in problem.machine.tiers}
    return StepSimulation(tuple(records), peak, sum(r.compute_s + r.exposed_s for r in records))


def check_within_budgets(problem: PlanProblem, plan: Plan) -> StepSimulation:
    """Simulate and raise BudgetExceeded at the first window where a tier overflows."""
    simulation = simulate(problem, plan)
    for record in simulation.windows:
        for tier, used in record.memory.items():
            capacity = problem.machine.tiers[tier].capacity_bytes
            if used > capacity:
                raise BudgetExceeded(tier, record.label, used, capacity)
    return simulation


def default_schedule(problem: PlanProblem, layers: tuple[LayerPlan, ...]):
    """Just-in-time copies for rule-based plans: an activation goes out during its own forward and
    comes back during the backward of the next layer; the snapshot is spread over the compute windows
    in proportion to their length. Returns (act_transfers, checkpoint_transfers)."""
    transfers = []
    for i, lp in enumerate(layers):
        if lp.offloaded:
            size = problem.layers[i].act_bytes[lp.act_bits]
            transfers.append(ActTransfer(i, "down", problem.forward_window(i), size))
            transfers.append(ActTransfer(i, "up", problem.backward_window(i + 1), size))
    compute = _compute_seconds(problem, layers)[:-1]
    total = sum(compute)
    snapshot = [problem.checkpoint_bytes_per_step * c / total for c in compute] if total > 0 else \
        [problem.checkpoint_bytes_per_step] + [0.0] * (len(compute) - 1)
    return tuple(transfers), tuple(snapshot + [0.0])


def evaluate_layers(problem: PlanProblem, layers, source: str, status: str = "heuristic") -> Plan:
    """A Plan for per-layer choices made by rules: default schedule, predictions from the simulator."""
    layers = tuple(layers)
    act_transfers, snapshot = default_schedule(problem, layers)
    draft = Plan(layers, act_transfers, snapshot, 0.0, {}, 0.0, source, status)
    simulation = simulate(problem, draft)
    return Plan(layers, act_transfers, snapshot, simulation.step_s, simulation.peak_bytes,
                simulation.step_s + quality_cost(problem, layers), source, status)


def _compute_seconds(problem: PlanProblem, layers) -> list[float]:
    compute = [0.0] * problem.num_windows
    for i, (costs, lp) in enumerate(zip(problem.layers, layers)):
        forward, backward = costs.window_seconds(lp.act)
        compute[problem.forward_window(i)] += forward
        compute[problem.backward_window(i)] += backward
        compute[problem.optimizer_window] += optimizer_step_s(problem, i, lp.placement)
        for traffic in placement_traffic(problem, i, lp.placement):
            compute[traffic.window] += blocking_seconds(problem, traffic)
    return compute


def _path_loads(problem: PlanProblem, plan: Plan) -> list[Counter]:
    machine = problem.machine
    loads = [Counter() for _ in range(problem.num_windows)]
    for i, lp in enumerate(plan.layers):
        for traffic in placement_traffic(problem, i, lp.placement):
            loads[traffic.window][traffic.path] += traffic.bytes
    for t in plan.act_transfers:
        tier = plan.layers[t.layer].act_tier
        route = machine.route_down(tier) if t.direction == "down" else machine.route_up(tier)
        for path in route:
            loads[t.window][path] += t.bytes
    for window, size in enumerate(plan.checkpoint_transfers):
        # Without snapshot traffic there may be no path for it (a machine with neither host tier
        # nor NVMe).
        for path in problem.checkpoint_route() if size else ():
            loads[window][path] += size
    return loads


def _check_schedule(problem: PlanProblem, plan: Plan) -> None:
    _require_close(sum(plan.checkpoint_transfers), problem.checkpoint_bytes_per_step, "checkpoint snapshot")
    moved = defaultdict(float)
    for t in plan.act_transfers:
        allowed = problem.activation_write_windows(t.layer) if t.direction == "down" \
            else problem.activation_read_windows(t.layer)
        if t.window not in allowed or not plan.layers[t.layer].offloaded or t.bytes < 0:
            raise ValueError(f"act_transfers: {t} is not allowed (window, layer mode or size)")
        moved[t.layer, t.direction] += t.bytes
    for i, lp in enumerate(plan.layers):
        if lp.offloaded:
            size = problem.layers[i].act_bytes[lp.act_bits]
            for direction in ("down", "up"):
                _require_close(moved[i, direction], size, f"layer {i} activations {direction}")


def _require_close(found: float, expected: float, what: str) -> None:
    if abs(found - expected) > SCHEDULE_RTOL * max(expected, 1.0):
        raise ValueError(f"act_transfers: {what}: the schedule moves {found} bytes, needs {expected}")


def _walk_memory(problem: PlanProblem, layers: tuple[LayerPlan, ...]) -> list[dict[str, float]]:
    machine, costs = problem.machine, problem.layers
    live = Counter({tier: 0.0 for tier in machine.tiers})
    live["gpu"] += problem.workspace_bytes + _device_buffers(problem, layers)
    live[problem.param_swap_tier()] += problem.param_swap_held(layers)
    live[problem.host_tier()] += problem.snapshot_held(layers)
    for c, lp in zip(costs, layers):
        live[lp.param_tier] += c.param_bytes
        live["gpu"] += c.engine_excess_held(lp.param_tier, lp.state_tier)
        live[lp.state_tier] += c.state_bytes(lp.state_8bit)
    host_grads = [machine.optimizer_on_host(lp.state_tier) for lp in layers]
    leaving = [machine.grads_leave_device(lp.state_tier) for lp in layers]
    memory = [None] * problem.num_windows
    for i, lp in enumerate(layers):
        live[_storage_tier(lp)] += _storage_bytes(costs[i], lp)
        memory[problem.forward_window(i)] = dict(live)
    for i in reversed(range(problem.num_layers)):
        live["gpu"] += costs[i].grad_bytes
        arriving = i + 1 < problem.num_layers and host_grads[i + 1]
        if arriving:
            live["cpu"] += costs[i + 1].grad_bytes
        left = i + 1 < problem.num_layers and leaving[i + 1]
        snapshot = dict(live)
        if layers[i].act_mode == "recompute":
            snapshot["gpu"] += costs[i].act_bytes[16]
        memory[problem.backward_window(i)] = snapshot
        live[_storage_tier(layers[i])] -= _storage_bytes(costs[i], layers[i])
        if left:
            live["gpu"] -= costs[i + 1].grad_bytes
    if host_grads[0]:
        live["cpu"] += costs[0].grad_bytes
    live["cpu" if machine.has_host else "gpu"] += max(
        [c.stage_bytes(lp.state_8bit) for c, lp in zip(costs, layers) if lp.state_tier == "nvme"], default=0)
    memory[problem.optimizer_window] = dict(live)
    return memory


def _storage_tier(lp: LayerPlan) -> str:
    return lp.act_tier if lp.act_mode == "keep" else "gpu"


def _storage_bytes(costs, lp: LayerPlan) -> int:
    return costs.act_bytes[lp.act_bits] if lp.act_mode == "keep" else costs.input_bytes


def _device_buffers(problem: PlanProblem, layers: tuple[LayerPlan, ...]) -> float:
    params = [c.param_bytes for c, lp in zip(problem.layers, layers) if lp.param_tier != "gpu"]
    acts = [c.act_bytes[lp.act_bits] for c, lp in zip(problem.layers, layers) if lp.offloaded]
    return 2 * max(params, default=0) + 2 * max(acts, default=0)
