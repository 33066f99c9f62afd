"""The planner's MILP (issue 7), solved with python-mip's CBC.

Binaries: per layer one activation option (kept at a width on a tier, or recomputed) and one placement
(parameter tier x optimizer-state tier x 8-bit state). Continuous: bytes of each offloaded activation
moved per allowed window and direction, snapshot bytes per window, exposed seconds per window, and
the sizes of the double buffers (the largest offloaded parameter / activation, the largest staged
NVMe optimizer state). Products of a binary and a transfer never appear: the transfers of layer i
to tier t must sum to the bytes its chosen option sends there, which is zero unless one is chosen.

Objective (seconds per step plus quality penalties): every window's compute (recompute included,
the optimizer step in the last window) + exposed copy time + quality costs of reduced widths.

Capacities are written only for the windows that can hold a tier's peak: every backward window and
the optimizer window (each forward window holds a subset of what the first backward window holds).
Byte quantities enter the model in GB so that CBC's coefficients stay within a few orders of
magnitude of the seconds they are compared with.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import mip

from lazyzero.planner.problem import (RECOMPUTE, ActTransfer, LayerPlan, Plan, PlanInfeasible, PlanProblem,
                                      activation_options, budget_shortfalls, optimizer_step_s,
                                      placement_options, placement_traffic, quality_cost)

GB = 1e9
_STATUS = {mip.OptimizationStatus.OPTIMAL: "optimal", mip.OptimizationStatus.FEASIBLE: "feasible"}


class SolverFoundNoPlan(RuntimeError):
    """CBC stopped (time limit) before finding any plan and there was no warm start to fall back on."""


@dataclass
class _Variables:
    model: mip.Model
    act: list[dict] = field(default_factory=list)        # act[i][ActChoice] -> binary
    place: list[dict] = field(default_factory=list)      # place[i][Placement] -> binary
    moves: dict = field(default_factory=dict)            # (i, direction, tier) -> {window: var}
    snapshot: dict = field(default_factory=dict)         # window -> var
    exposed: list = field(default_factory=list)
    durations: list = field(default_factory=list)
    usage: dict = field(default_factory=lambda: defaultdict(list))  # tier -> capacity expressions
    buffers: dict = field(default_factory=dict)          # "param" / "act" / "stage" -> GB variable


def solve(problem: PlanProblem, time_limit_s: float = 10, max_gap: float = 0.01,
          warm_start: Plan | None = None) -> Plan:
    """Optimal (or, at the time limit, best found) plan. Without `warm_start` the greedy plan is
    used when one exists; when CBC has found no plan by the time limit, the warm start is returned
    as it is. Raises PlanInfeasible naming the binding budget(s)."""
    from lazyzero.planner.greedy import greedy_plan

    started = time.perf_counter()
    if warm_start is None:
        try:
            warm_start = greedy_plan(problem)
        except PlanInfeasible:
            warm_start = None
    v = build_model(problem)
    v.model.max_mip_gap = max_gap
    if warm_start is not None:
        v.model.start = _start_values(v, warm_start)
    status = v.model.optimize(max_seconds=time_limit_s)
    if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
        raise budget_shortfalls(problem)
    if status not in _STATUS:
        if warm_start is not None:
            return warm_start
        raise SolverFoundNoPlan(f"CBC returned {status.name} within {time_limit_s} s")
    return _extract(problem, v, _STATUS[status], time.perf_counter() - started)


def build_model(problem: PlanProblem) -> _Variables:
    """The MILP with every constraint named (e.g. "one_act[3]", "gpu_capacity[b2]", "bandwidth[d2h,w12]")."""
    v = _Variables(mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC))
    v.model.verbose = 0
    _add_choices(problem, v)
    _add_activation_moves(problem, v)
    _add_snapshot(problem, v)
    _add_buffers(problem, v)
    _add_capacities(problem, v)
    _add_time(problem, v)
    return v


def _add_choices(problem: PlanProblem, v: _Variables) -> None:
    for i in range(problem.num_layers):
        v.act.append({o: v.model.add_var(f"act[{i},{o.mode},{o.bits},{o.tier}]", var_type=mip.BINARY)
                      for o in activation_options(problem, i)})
        v.place.append({p: v.model.add_var(f"place[{i},{p.param_tier},{p.state_tier},{int(p.state_8bit)}]",
                                           var_type=mip.BINARY) for p in placement_options(problem, i)})
        v.model.add_constr(mip.xsum(v.act[i].values()) == 1, name=f"one_act[{i}]")
        v.model.add_constr(mip.xsum(v.place[i].values()) == 1, name=f"one_placement[{i}]")


def _kept_bytes(problem: PlanProblem, v: _Variables, i: int, tier: str):
    """GB of layer i's activations stored on `tier` (for the device: also a recomputed layer's input)."""
    costs = problem.layers[i]
    terms = [costs.act_bytes[o.bits] / GB * x for o, x in v.act[i].items() if o.mode == "keep" and o.tier == tier]
    if tier == "gpu" and RECOMPUTE in v.act[i]:
        terms.append(costs.input_bytes / GB * v.act[i][RECOMPUTE])
    return mip.xsum(terms)


def _add_activation_moves(problem: PlanProblem, v: _Variables) -> None:
    for i in range(problem.num_layers):
        for tier in {o.tier for o in v.act[i] if o.tier != "gpu"}:
            for direction, windows in (("down", problem.activation_write_windows(i)),
                                       ("up", problem.activation_read_windows(i))):
                moves = {w: v.model.add_var(f"move[{i},{direction},{tier},{w}]") for w in windows}
                v.moves[i, direction, tier] = moves
                v.model.add_constr(mip.xsum(moves.values()) == _kept_bytes(problem, v, i, tier),
                                   name=f"act_{direction}[{i},{tier}]")


def _add_snapshot(problem: PlanProblem, v: _Variables) -> None:
    if problem.checkpoint_bytes_per_step == 0:
        return
    v.snapshot = {w: v.model.add_var(f"snapshot[{w}]") for w in range(problem.num_windows)}
    v.model.add_constr(mip.xsum(v.snapshot.values()) == problem.checkpoint_bytes_per_step / GB,
                       name="checkpoint_traffic")


def _add_buffers(problem: PlanProblem, v: _Variables) -> None:
    """Largest offloaded parameter, largest offloaded activation, largest NVMe-staged state (GB)."""
    buffers = v.buffers = {name: v.model.add_var(f"{name}_buffer") for name in ("param", "act", "stage")}
    for i, costs in enumerate(problem.layers):
        v.model.add_constr(buffers["param"] >= mip.xsum(
            costs.param_bytes / GB * x for p, x in v.place[i].items() if p.param_tier != "gpu"),
            name=f"param_buffer[{i}]")
        v.model.add_constr(buffers["act"] >= mip.xsum(
            costs.act_bytes[o.bits] / GB * x for o, x in v.act[i].items() if o.mode == "keep" and o.tier != "gpu"),
            name=f"act_buffer[{i}]")
        v.model.add_constr(buffers["stage"] >= mip.xsum(
            costs.state_bytes(p.state_8bit) / GB * x for p, x in v.place[i].items() if p.state_tier == "nvme"),
            name=f"stage_buffer[{i}]")


def _resident(problem: PlanProblem, v: _Variables, tier: str) -> mip.Var:
    """GB of parameters and optimizer states that live on `tier` all step (one variable, so that the
    many capacity rows that use it stay short)."""
    total = v.model.add_var(f"resident[{tier}]")
    v.model.add_constr(total == mip.xsum(
        (c.param_bytes * (p.param_tier == tier) + c.state_bytes(p.state_8bit) * (p.state_tier == tier)) / GB * x
        for c, place in zip(problem.layers, v.place) for p, x in place.items()), name=f"resident[{tier}]")
    return total


def _host_optimizer(problem: PlanProblem, v: _Variables, i: int):
    """1 when layer i's optimizer runs on the host (its gradients leave the device after backward)."""
    return mip.xsum(x for p, x in v.place[i].items() if problem.machine.optimizer_on_host(p.state_tier))


def _running_sums(v: _Variables, name: str, parts: list) -> list[mip.Var]:
    """sums[i] = parts[0] + ... + parts[i], chained so that each row has a few terms."""
    sums = []
    for i, part in enumerate(parts):
        total = v.model.add_var(f"{name}[{i}]")
        v.model.add_constr(total == (sums[-1] if sums else 0) + part, name=f"{name}[{i}]")
        sums.append(total)
    return sums


def _add_capacities(problem: PlanProblem, v: _Variables) -> None:
    machine, layers, n, buffers = problem.machine, problem.layers, problem.num_layers, v.buffers
    host_opt = [_host_optimizer(problem, v, i) for i in range(n)]
    grad_gb = [c.grad_bytes / GB for c in layers]
    # Gradients of layers i+1.. still on the device (device optimizer) or already on the host.
    device_grads_after = _running_sums(v, "device_grads_after", [0] + [
        grad_gb[j] * (1 - host_opt[j]) for j in reversed(range(1, n))])[::-1]
    host_grads_after = _running_sums(v, "host_grads_after", [0] + [
        grad_gb[j] * host_opt[j] for j in reversed(range(1, n))])[::-1]
    kept = {tier: _running_sums(v, f"kept_{tier}", [_kept_bytes(problem, v, j, tier) for j in range(n)])
            for tier in machine.tiers}
    resident = {tier: _resident(problem, v, tier) for tier in machine.tiers}
    device_fixed = problem.workspace_bytes / GB + resident["gpu"] + 2 * buffers["param"] + 2 * buffers["act"]
    for i in range(n):
        moving = grad_gb[i + 1] * host_opt[i + 1] if i + 1 < n else 0
        recompute = layers[i].act_bytes[16] / GB * v.act[i].get(RECOMPUTE, 0)
        _capacity(problem, v, "gpu", f"b{i}",
                  device_fixed + kept["gpu"][i] + grad_gb[i] + device_grads_after[i] + moving + recompute)
    _capacity(problem, v, "gpu", "opt", device_fixed + grad_gb[0] + device_grads_after[0]
              + (0 if machine.has_host else buffers["stage"]))
    if machine.has_host:
        for i in range(n):
            _capacity(problem, v, "cpu", f"b{i}", resident["cpu"] + kept["cpu"][i] + host_grads_after[i])
        _capacity(problem, v, "cpu", "opt", resident["cpu"] + buffers["stage"] + host_grads_after[0]
                  + grad_gb[0] * host_opt[0])
    if "nvme" in machine.tiers:
        _capacity(problem, v, "nvme", f"b{n - 1}", resident["nvme"] + kept["nvme"][n - 1])


def _capacity(problem: PlanProblem, v: _Variables, tier: str, window: str, usage) -> None:
    v.usage[tier].append(usage)
    v.model.add_constr(usage <= problem.machine.tiers[tier].capacity_bytes / GB, name=f"{tier}_capacity[{window}]")


def _path_terms(problem: PlanProblem, v: _Variables) -> dict:
    """(window, path) -> GB expressions loading that path in that window."""
    machine, terms = problem.machine, defaultdict(list)
    for i in range(problem.num_layers):
        for p, x in v.place[i].items():
            for t in placement_traffic(problem, i, p):
                terms[t.window, t.path].append(t.bytes / GB * x)
    for (i, direction, tier), moves in v.moves.items():
        route = machine.route_down(tier) if direction == "down" else machine.route_up(tier)
        for w, x in moves.items():
            for path in route:
                terms[w, path].append(x)
    for w, x in v.snapshot.items():
        for path in problem.checkpoint_route():
            terms[w, path].append(x)
    return terms


def _add_time(problem: PlanProblem, v: _Variables) -> None:
    durations = [0.0] * problem.num_windows
    quality = []
    for i, costs in enumerate(problem.layers):
        durations[problem.forward_window(i)] += costs.fwd_s
        durations[problem.backward_window(i)] += costs.bwd_s + costs.fwd_s * v.act[i].get(RECOMPUTE, 0)
        durations[problem.optimizer_window] += mip.xsum(
            optimizer_step_s(problem, i, p) * x for p, x in v.place[i].items())
        quality += [costs.quality_cost[o.bits] * x for o, x in v.act[i].items() if o.mode == "keep"]
    v.durations = durations
    v.exposed = [v.model.add_var(f"exposed[{w}]") for w in range(problem.num_windows)]
    for (w, path), terms in _path_terms(problem, v).items():
        seconds_per_gb = GB / problem.machine.paths[path].bytes_per_s
        v.model.add_constr(seconds_per_gb * mip.xsum(terms) <= durations[w] + v.exposed[w],
                           name=f"bandwidth[{path},w{w}]")
    v.model.objective = mip.minimize(mip.xsum(durations) + mip.xsum(v.exposed) + mip.xsum(quality))


def _start_values(v: _Variables, plan: Plan) -> list[tuple[mip.Var, float]]:
    """The warm start's binaries; CBC completes the continuous part by solving the LP."""
    start = []
    for lp, act, place in zip(plan.layers, v.act, v.place):
        start += [(x, float(o == lp.act)) for o, x in act.items()]
        start += [(x, float(p == lp.placement)) for p, x in place.items()]
    return start


def _extract(problem: PlanProblem, v: _Variables, status: str, solve_s: float) -> Plan:
    layers = tuple(LayerPlan.of(_chosen(act), _chosen(place)) for act, place in zip(v.act, v.place))
    transfers = []
    for (i, direction, tier), moves in v.moves.items():
        if layers[i].offloaded and layers[i].act_tier == tier:
            size = problem.layers[i].act_bytes[layers[i].act_bits]
            transfers += [ActTransfer(i, direction, w, b) for w, b in _rescaled(moves, size).items() if b > 0]
    snapshot = _rescaled(v.snapshot, problem.checkpoint_bytes_per_step) if v.snapshot else {}
    step_s = sum(_value(d) for d in v.durations) + sum(max(e.x, 0.0) for e in v.exposed)
    exact_buffers = _exact_buffers(problem, v, layers)
    peaks = {tier: max(_evaluate(e, exact_buffers) for e in exprs) * GB for tier, exprs in v.usage.items()}
    snapshot_per_window = tuple(snapshot.get(w, 0.0) for w in range(problem.num_windows))
    return Plan(layers, tuple(transfers), snapshot_per_window, step_s, peaks, step_s + quality_cost(problem, layers),
                "milp", status, gap=max(v.model.gap, 0.0), solve_s=solve_s)


def _exact_buffers(problem: PlanProblem, v: _Variables, layers: tuple[LayerPlan, ...]) -> dict:
    """Buffer sizes (GB) the chosen layers need: the solver may leave a buffer variable larger than
    needed where its capacity row is slack, which would overstate the predicted peak."""
    def largest(sizes):
        return max(sizes, default=0) / GB

    costs = list(zip(problem.layers, layers))
    return {v.buffers["param"]: largest(c.param_bytes for c, lp in costs if lp.param_tier != "gpu"),
            v.buffers["act"]: largest(c.act_bytes[lp.act_bits] for c, lp in costs if lp.offloaded),
            v.buffers["stage"]: largest(c.state_bytes(lp.state_8bit) for c, lp in costs if lp.state_tier == "nvme")}


def _evaluate(expression: mip.LinExpr, overrides: dict) -> float:
    return expression.const + sum(coef * overrides.get(var, var.x) for var, coef in expression.expr.items())


def _rescaled(moves: dict, total_bytes: float) -> dict[int, float]:
    """Window -> bytes, scaled to sum to exactly `total_bytes` (CBC meets the sum only to its
    feasibility tolerance, about 1e-7 GB)."""
    values = {w: max(x.x, 0.0) for w, x in moves.items()}
    found = sum(values.values())
    return {w: total_bytes * value / found for w, value in values.items()}


def _chosen(options: dict):
    return max(options, key=lambda o: options[o].x)


def _value(expression) -> float:
    return expression if isinstance(expression, float) else expression.x
