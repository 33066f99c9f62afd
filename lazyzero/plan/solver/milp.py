"""The planner's MILP (docs/plan.md), solved with python-mip's CBC.

Binaries: per layer one activation option (kept at a width on a tier, or recomputed) and one placement
(parameter tier x optimizer-state tier x 8-bit state). Continuous: activation bytes copied to and
from each tier per window (summed over layers, see milp_transfers.py), snapshot bytes per
window, exposed seconds per window, and the sizes of the double buffers (the largest offloaded
parameter / activation, the largest staged NVMe optimizer state). Products of a binary and a
transfer never appear: the flows must carry exactly the bytes the chosen options send, which is
zero for a layer unless one is chosen. Integer counts of layers per tier (_add_counts) only guide
the search.

Objective (seconds per step plus quality penalties): every window's compute (recompute included,
the optimizer step in the last window) + exposed copy time + quality costs of reduced widths.

Capacities are written only for the windows that can hold a tier's peak: every backward window and
the optimizer window (each forward window holds a subset of what the first backward window holds).
Byte quantities enter the model in GB so that CBC's coefficients stay within a few orders of
magnitude of the seconds they are compared with.

Solving (docs/plan.md sets the target of 80 layers in <= 10 s within 1%): an LP relaxation gives a bound and, by
fixing its integral placements, a near-optimal start (_lp_guided_start); CBC then searches with the
stopping rule stated on the step time (see `solve`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import mip

from lazyzero.plan.solver.greedy import greedy_plan
from lazyzero.plan.solver.milp_transfers import GB, add_activation_flows, flow_window, per_layer_transfers
from lazyzero.plan.solver.problem import (
    PLACED_KINDS,
    RECOMPUTE,
    LayerPlan,
    Plan,
    PlanInfeasible,
    PlanProblem,
    activation_options,
    blocking_seconds,
    budget_shortfalls,
    optimizer_step_s,
    placement_options,
    placement_traffic,
    quality_cost,
)

_STATUS = {mip.OptimizationStatus.OPTIMAL: "optimal", mip.OptimizationStatus.FEASIBLE: "feasible"}


class SolverFoundNoPlan(RuntimeError):
    """CBC stopped (time limit) before finding any plan and there was no warm start to fall back on."""


# Share of the time limit the RENS-style start may use (_lp_guided_start); at least MIN_SEARCH_S is
# left to the search that proves the gap.
RELAXATION_SHARE_OF_TIME = 0.3
MIN_SEARCH_S = 0.1
# An LP value this close to 0 or 1 counts as integral.
_LP_INTEGRAL = 1e-6


@dataclass
class _Variables:
    model: mip.Model
    problem: PlanProblem
    act: list[dict] = field(default_factory=list)        # act[i][ActChoice] -> binary
    place: list[dict] = field(default_factory=list)      # place[i][Placement] -> binary
    flows: dict = field(default_factory=dict)            # (direction, tier) -> {layer: var}, see milp_transfers
    snapshot: dict = field(default_factory=dict)         # window -> var
    exposed: list = field(default_factory=list)
    durations: list = field(default_factory=list)
    usage: dict = field(default_factory=lambda: defaultdict(list))  # tier -> capacity expressions
    buffers: dict = field(default_factory=dict)          # "param" / "act" / "stage" -> GB variable
    choice_group: dict = field(default_factory=dict)     # binary -> ("act" | "place", layer): one per group is 1


def solve(problem: PlanProblem, time_limit_s: float = 10, max_gap: float = 0.01,
          warm_start: Plan | None = None) -> Plan:
    """Optimal (or, at the time limit, best found) plan. Without `warm_start` the greedy plan is
    used when one exists; when CBC has found no plan by the time limit, the warm start is returned
    as it is. Raises PlanInfeasible naming the binding budget(s)."""
    started = time.perf_counter()
    if warm_start is None:
        try:
            warm_start = greedy_plan(problem)
        except PlanInfeasible:
            warm_start = None
    v = build_model(problem)
    _configure(v.model, max_gap)
    lp_bound, start = _lp_guided_start(v, warm_start, RELAXATION_SHARE_OF_TIME * time_limit_s)
    # A stopping rule on the step time itself: CBC's relative gap leaves out the objective's
    # constant (the compute every plan pays), so on its own it searches on where the reported gap
    # is already below max_gap (80 layers: 1.16% for CBC is 0.94% of the step time). Stopping when
    # best - bound <= max_gap * LP bound keeps (best - bound) / best <= max_gap.
    v.model.max_mip_gap_abs = max(max_gap * lp_bound, 1e-10)
    if start:
        v.model.start = start
    remaining = time_limit_s - (time.perf_counter() - started)
    status = v.model.optimize(max_seconds=max(remaining, MIN_SEARCH_S))
    if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
        raise budget_shortfalls(problem)
    if status not in _STATUS:
        if warm_start is not None:
            return warm_start
        raise SolverFoundNoPlan(f"CBC returned {status.name} within {time_limit_s} s")
    return _extract(problem, v, _STATUS[status], time.perf_counter() - started)


def _configure(model: mip.Model, max_gap: float) -> None:
    """CBC settings, chosen by measurement (docs/plan.md: 80-layer, 7b and 27b instances; threads,
    cut levels and emphasis made no difference or were slower). Preprocessing is off because it
    substitutes the count variables (_add_counts) away, and without them the 7b instance stalls
    at a 1.3-1.5% gap for the whole time limit."""
    model.max_mip_gap = max_gap
    model.preprocess = 0


def _lp_guided_start(v: _Variables, warm_start: Plan | None, seconds: float):
    """(LP bound, MIP start). The LP relaxation's value bounds every plan's objective from below.
    The start is the better of `warm_start` and a RENS-style plan (relaxation induced neighbourhood
    search): fix every placement binary that the LP relaxation sets to 0 or 1, solve the much
    smaller MILP over the rest for at most `seconds`, release the bounds. Why: CBC's own heuristics
    find poor plans on these nearly symmetric instances (80 layers: 3.13-3.29 s after 10 s, where
    this finds 3.112 in about a second); the LP relaxation picks placements well, and only which
    layers recompute or quantize is left to search. Raises PlanInfeasible if the relaxation is."""
    model = v.model
    with _native_stdout_silenced():  # Clp prints the LP log whatever python-mip's verbose says
        status = model.optimize(relax=True)
    if status == mip.OptimizationStatus.INFEASIBLE:
        raise budget_shortfalls(v.problem)
    if status != mip.OptimizationStatus.OPTIMAL:
        return 0.0, _start_values(v, warm_start) if warm_start else None
    lp_bound = model.objective_value
    fixed = [(x, x.lb, x.ub) for place in v.place for x in place.values()
             if x.x < _LP_INTEGRAL or x.x > 1 - _LP_INTEGRAL]
    for x, _, _ in fixed:
        x.lb = x.ub = float(round(x.x))
    status = model.optimize(max_seconds=seconds)
    found = status in _STATUS and (warm_start is None or model.objective_value < warm_start.objective)
    start = _solution_values(v) if found else (_start_values(v, warm_start) if warm_start else None)
    for x, lb, ub in fixed:
        x.lb, x.ub = lb, ub
    return lp_bound, start


@contextlib.contextmanager
def _native_stdout_silenced():
    """Send file descriptor 1 to /dev/null while native code runs (what it buffered is flushed
    there too, before the descriptor is restored)."""
    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def build_model(problem: PlanProblem) -> _Variables:
    """The MILP with every constraint named (e.g. "one_act[3]", "gpu_capacity[b2]", "bandwidth[d2h,w12]")."""
    v = _Variables(mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC), problem)
    v.model.verbose = 0
    _add_choices(problem, v)
    _add_offload_all_or_none(problem, v)
    _add_activation_flows(problem, v)
    _add_snapshot(problem, v)
    _add_buffers(problem, v)
    _add_capacities(problem, v)
    _add_time(problem, v)
    _add_counts(problem, v)
    return v


def _add_counts(problem: PlanProblem, v: _Variables) -> None:
    """Integer counts of the layers whose optimizer state (parameters) live on each tier. They add
    no constraint (each is the sum of binaries), but they give CBC something to branch on and to
    round in its cuts: many layers cost the same, so the LP relaxation spreads e.g. 0.7 of a GPU
    state over several layers, and fixing any one of them to 0 or 1 moves the bound little, while
    "at most 11 GPU states" / "at least 12" splits the search where it matters (7b instance: gap
    1.3-1.5% after 10 s without them, within 1% in 2-5 s with them). Added last: CBC's search
    depends on the column order, and this order did best on the 7b and 80-layer variants measured."""
    groups = defaultdict(list)
    for place in v.place:
        for p, x in place.items():
            groups["state", p.state_tier].append(x)
            groups["param", p.param_tier].append(x)
    for (kind, tier), binaries in groups.items():
        count = v.model.add_var(f"count_{kind}[{tier}]", var_type=mip.INTEGER, ub=problem.num_layers)
        v.model.add_constr(count == mip.xsum(binaries), name=f"count_{kind}[{tier}]")


def _add_choices(problem: PlanProblem, v: _Variables) -> None:
    for i in range(problem.num_layers):
        v.act.append({o: v.model.add_var(f"act[{i},{o.mode},{o.bits},{o.tier}]", var_type=mip.BINARY)
                      for o in activation_options(problem, i)})
        v.place.append({p: v.model.add_var(f"place[{i},{p.param_tier},{p.state_tier},{int(p.state_8bit)}]",
                                           var_type=mip.BINARY) for p in placement_options(problem, i)})
        v.choice_group.update({x: ("act", i) for x in v.act[i].values()})
        v.choice_group.update({x: ("place", i) for x in v.place[i].values()})
        v.model.add_constr(mip.xsum(v.act[i].values()) == 1, name=f"one_act[{i}]")
        v.model.add_constr(mip.xsum(v.place[i].values()) == 1, name=f"one_placement[{i}]")


def _add_offload_all_or_none(problem: PlanProblem, v: _Variables) -> None:
    """Under offload_all_or_none, each kind is on the device in every layer exactly when in layer 0."""
    if not problem.offload_all_or_none:
        return

    def on_device(i: int, attribute: str):
        return mip.xsum(x for p, x in v.place[i].items() if getattr(p, attribute) == "gpu")

    for kind, attribute in PLACED_KINDS.items():
        for i in range(1, problem.num_layers):
            v.model.add_constr(on_device(i, attribute) == on_device(0, attribute),
                               name=f"offload_all_or_none[{kind},{i}]")


def _kept_bytes(problem: PlanProblem, v: _Variables, i: int, tier: str):
    """GB of layer i's activations stored on `tier` (for the device: also a recomputed layer's input)."""
    costs = problem.layers[i]
    terms = [costs.act_bytes[o.bits] / GB * x for o, x in v.act[i].items() if o.mode == "keep" and o.tier == tier]
    if tier == "gpu" and RECOMPUTE in v.act[i]:
        terms.append(costs.input_bytes / GB * v.act[i][RECOMPUTE])
    return mip.xsum(terms)


def _add_activation_flows(problem: PlanProblem, v: _Variables) -> None:
    tiers = sorted({o.tier for act in v.act for o in act if o.tier != "gpu"})
    kept = {tier: [_kept_bytes(problem, v, i, tier) for i in range(problem.num_layers)] for tier in tiers}
    v.flows = add_activation_flows(problem, v.model, kept)


def _add_snapshot(problem: PlanProblem, v: _Variables) -> None:
    if problem.checkpoint_bytes_per_step == 0:
        return
    v.snapshot = {w: v.model.add_var(f"snapshot[{w}]") for w in range(problem.num_windows)}
    v.model.add_constr(mip.xsum(v.snapshot.values()) == problem.checkpoint_bytes_per_step / GB,
                       name="checkpoint_traffic")


def _add_buffers(problem: PlanProblem, v: _Variables) -> None:
    """Largest offloaded parameter, largest offloaded activation, largest NVMe-staged state (GB)."""
    buffers = v.buffers = {name: v.model.add_var(f"{name}_buffer") for name in ("param", "act", "stage")}
    # 1 when any layer's parameters are on NVMe: DeepSpeed's parameter swapper then holds its buffers.
    buffers["param_swap"] = v.model.add_var("param_swap_held", var_type=mip.BINARY)
    for i, costs in enumerate(problem.layers):
        v.model.add_constr(buffers["param_swap"] >= mip.xsum(
            x for p, x in v.place[i].items() if p.param_tier == "nvme"), name=f"param_swap_held[{i}]")
        v.model.add_constr(buffers["param"] >= mip.xsum(
            costs.param_bytes / GB * x for p, x in v.place[i].items() if p.param_tier != "gpu"),
            name=f"param_buffer[{i}]")
        v.model.add_constr(buffers["act"] >= mip.xsum(
            costs.act_bytes[o.bits] / GB * x for o, x in v.act[i].items() if o.mode == "keep" and o.tier != "gpu"),
            name=f"act_buffer[{i}]")
        v.model.add_constr(buffers["stage"] >= mip.xsum(
            costs.stage_bytes(p.state_8bit) / GB * x for p, x in v.place[i].items() if p.state_tier == "nvme"),
            name=f"stage_buffer[{i}]")


def _resident(problem: PlanProblem, v: _Variables, tier: str) -> mip.Var:
    """GB of parameters and optimizer states that live on `tier` all step (one variable, so that the
    many capacity rows that use it stay short)."""
    total = v.model.add_var(f"resident[{tier}]")
    v.model.add_constr(total == mip.xsum(
        (c.param_bytes * (p.param_tier == tier) + c.engine_excess_held(p.param_tier, p.state_tier) * (tier == "gpu")
         + c.state_bytes(p.state_8bit) * (p.state_tier == tier)) / GB * x
        for c, place in zip(problem.layers, v.place) for p, x in place.items())
        + (_snapshot(problem, v) if tier == problem.host_tier() else 0), name=f"resident[{tier}]")
    return total


def _snapshot(problem: PlanProblem, v: _Variables):
    """GB a lazy checkpoint's snapshot holds from its first save on (problem.SnapshotMemory). Under
    `host_buffer_limit` the least of the limit and the largest snapshot any placement gives: a
    constant, as a minimum would not be linear."""
    if problem.snapshot is None:
        return 0
    if problem.snapshot.limit_bytes is not None:
        largest = problem.snapshot_other_bytes() + sum(max(problem.snapshot_layer_bytes(i, p) for p in place)
                                                       for i, place in enumerate(v.place))
        return min(largest, problem.snapshot.limit_bytes) / GB
    return problem.snapshot_other_bytes() / GB + mip.xsum(
        problem.snapshot_layer_bytes(i, p) / GB * x for i, place in enumerate(v.place) for p, x in place.items())


def _host_optimizer(problem: PlanProblem, v: _Variables, i: int):
    """1 when layer i's optimizer runs on the host (its gradients go there after backward)."""
    return mip.xsum(x for p, x in v.place[i].items() if problem.machine.optimizer_on_host(p.state_tier))


def _grads_leave(problem: PlanProblem, v: _Variables, i: int):
    """1 when layer i's gradients leave the device after its backward (to the host, or to NVMe)."""
    return mip.xsum(x for p, x in v.place[i].items() if problem.machine.grads_leave_device(p.state_tier))


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
    leave = [_grads_leave(problem, v, i) for i in range(n)] if machine.nvme_state_takes_grads else host_opt
    grad_gb = [c.grad_bytes / GB for c in layers]
    # Gradients of layers i+1.. still on the device (device optimizer) or already on the host.
    device_grads_after = _running_sums(v, "device_grads_after", [0] + [
        grad_gb[j] * (1 - leave[j]) for j in reversed(range(1, n))])[::-1]
    host_grads_after = _running_sums(v, "host_grads_after", [0] + [
        grad_gb[j] * host_opt[j] for j in reversed(range(1, n))])[::-1]
    kept = {tier: _running_sums(v, f"kept_{tier}", [_kept_bytes(problem, v, j, tier) for j in range(n)])
            for tier in machine.tiers}
    resident = {tier: _resident(problem, v, tier) for tier in machine.tiers}
    param_swap = problem.param_swap_bytes / GB * buffers["param_swap"]
    swap_on = {problem.param_swap_tier(): param_swap}
    device_fixed = (problem.workspace_bytes / GB + resident["gpu"] + 2 * buffers["param"] + 2 * buffers["act"]
                    + swap_on.get("gpu", 0))
    host_fixed = resident["cpu"] + swap_on.get("cpu", 0) if machine.has_host else None
    for i in range(n):
        moving = grad_gb[i + 1] * leave[i + 1] if i + 1 < n else 0
        recompute = layers[i].act_bytes[16] / GB * v.act[i].get(RECOMPUTE, 0)
        _capacity(problem, v, "gpu", f"b{i}",
                  device_fixed + kept["gpu"][i] + grad_gb[i] + device_grads_after[i] + moving + recompute)
    _capacity(problem, v, "gpu", "opt", device_fixed + grad_gb[0] + device_grads_after[0]
              + (0 if machine.has_host else buffers["stage"]))
    if machine.has_host:
        for i in range(n):
            _capacity(problem, v, "cpu", f"b{i}", host_fixed + kept["cpu"][i] + host_grads_after[i])
        _capacity(problem, v, "cpu", "opt", host_fixed + buffers["stage"] + host_grads_after[0]
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
    for (direction, tier), flows in v.flows.items():
        route = machine.route_down(tier) if direction == "down" else machine.route_up(tier)
        for i, x in flows.items():
            for path in route:
                terms[flow_window(problem, direction, i), path].append(x)
    for w, x in v.snapshot.items():
        for path in problem.checkpoint_route():
            terms[w, path].append(x)
    return terms


def _durations(problem: PlanProblem, v: _Variables) -> list[mip.LinExpr]:
    """Compute seconds per window: a constant (the least the window can take) plus non-negative
    multiples of binaries (recompute, packing and offloading work; blocking NVMe swaps; the
    optimizer step above its fastest placement)."""
    durations = [mip.LinExpr() for _ in range(problem.num_windows)]
    for i, costs in enumerate(problem.layers):
        durations[problem.forward_window(i)].add_const(costs.fwd_s)
        durations[problem.backward_window(i)].add_const(costs.bwd_s)
        for option, x in v.act[i].items():
            forward, backward = costs.window_seconds(option)
            if forward > costs.fwd_s:
                durations[problem.forward_window(i)].add_var(x, forward - costs.fwd_s)
            if backward > costs.bwd_s:
                durations[problem.backward_window(i)].add_var(x, backward - costs.bwd_s)
        for p, x in v.place[i].items():
            for traffic in placement_traffic(problem, i, p):
                if blocking_seconds(problem, traffic) > 0:
                    durations[traffic.window].add_var(x, blocking_seconds(problem, traffic))
        steps = {p: optimizer_step_s(problem, i, p) for p in v.place[i]}
        fastest = min(steps.values())
        durations[problem.optimizer_window].add_const(fastest)
        for p, x in v.place[i].items():
            if steps[p] > fastest:
                durations[problem.optimizer_window].add_var(x, steps[p] - fastest)
    return durations


def _add_time(problem: PlanProblem, v: _Variables) -> None:
    v.durations = _durations(problem, v)
    quality = [costs.quality_cost[o.bits] * x for costs, act in zip(problem.layers, v.act)
               for o, x in act.items() if o.mode == "keep" and costs.quality_cost[o.bits] > 0]
    v.exposed = [v.model.add_var(f"exposed[{w}]") for w in range(problem.num_windows)]
    for (w, path), terms in _path_terms(problem, v).items():
        load = GB / problem.machine.paths[path].bytes_per_s * mip.xsum(terms)
        v.model.add_constr(load <= v.durations[w] + v.exposed[w], name=f"bandwidth[{path},w{w}]")
        _add_exposure_floor(v, w, path, load)
    v.model.objective = mip.minimize(mip.xsum(v.durations) + mip.xsum(v.exposed) + mip.xsum(quality))


def _add_exposure_floor(v: _Variables, w: int, path: str, load: mip.LinExpr) -> None:
    """exposed[w] >= sum_j c_j x_j - sum_k min(g_k, G) y_k, a valid inequality that tightens the LP
    relaxation (docs/plan.md, solve time). Window w lasts d0 + sum_k g_k y_k (d0 its constant part, y_k
    binaries, g_k > 0); binary x_j puts s_j seconds on the path; c_j = max(s_j - d0, 0); G bounds
    sum c_j over any plan (the largest c_j of each layer's option group, one option being chosen).

    Why it is valid, for a plan choosing the x in S and the y in K: let A = sum of c_j over S (<= G).
    If some chosen g_k >= G the right side is <= A - G <= 0. Otherwise it is A - sum_K g_k, and A <=
    sum_S s_j - d0 whenever A > 0 (at least one term, d0 >= 0; flows only add load), so it is at most
    load - duration <= exposed. Why it helps: the bandwidth row alone lets the LP put a third of a
    parameter whose prefetch takes three compute windows on the path for free (max(0, 3x - 1) = 0 at
    x = 1/3); this row charges 2x (80-layer instance: the root bound rises from 3.090 to 3.103).
    """
    d0 = v.durations[w].const
    excess = {x: s - d0 for x, s in load.expr.items() if x.var_type == mip.BINARY and s > d0}
    if not excess:
        return
    most = defaultdict(float)  # one option per layer and kind: the largest excess each can add
    for x, c in excess.items():
        most[v.choice_group[x]] = max(most[v.choice_group[x]], c)
    total = sum(most.values())
    v.model.add_constr(v.exposed[w] >= mip.xsum(c * x for x, c in excess.items())
                       - mip.xsum(min(g, total) * y for y, g in v.durations[w].expr.items()),
                       name=f"exposed_floor[{path},w{w}]")


def _start_values(v: _Variables, plan: Plan) -> list[tuple[mip.Var, float]]:
    """The warm start's binaries; CBC completes the continuous part by solving the LP."""
    start = []
    for lp, act, place in zip(plan.layers, v.act, v.place):
        start += [(x, float(o == lp.act)) for o, x in act.items()]
        start += [(x, float(p == lp.placement)) for p, x in place.items()]
    return start


def _solution_values(v: _Variables) -> list[tuple[mip.Var, float]]:
    """The binaries of the plan CBC holds, as a start for the next solve."""
    return [(x, float(round(x.x))) for options in v.act + v.place for x in options.values()]


def _extract(problem: PlanProblem, v: _Variables, status: str, solve_s: float) -> Plan:
    layers = tuple(LayerPlan.of(_chosen(act), _chosen(place)) for act, place in zip(v.act, v.place))
    transfers = per_layer_transfers(problem, v.flows, layers)
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
            v.buffers["stage"]: largest(c.stage_bytes(lp.state_8bit) for c, lp in costs if lp.state_tier == "nvme"),
            v.buffers["param_swap"]: float(any(lp.param_tier == "nvme" for lp in layers))}


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


def _value(expression: mip.LinExpr) -> float:
    return _evaluate(expression, {})
