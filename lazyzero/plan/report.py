"""What `lazyzero plan` shows and writes (docs/plan.md): the plan as a table, a plot of memory per tier
over the step, and the baselines' predictions beside it (the DeepSpeed config a plan implies is
`deepspeed/implied.py`'s)."""

from __future__ import annotations

import io
from pathlib import Path as FilePath

from lazyzero.plan.solver.baselines import deepspeed_default_plan, fixed_rule_plan
from lazyzero.plan.solver.greedy import greedy_plan
from lazyzero.plan.solver.problem import BIT_WIDTHS, REDUCED_WIDTHS, LayerCosts, Plan, PlanInfeasible, PlanProblem
from lazyzero.plan.solver.simulate import BudgetExceeded, check_within_budgets, simulate, window_label

GB = 1e9
TABLE_WIDTH = 130
# Layers between the activations LazyTrain's fixed rule keeps (its paper's default).
FIXED_RULE_K = 4


def plan_table(problem: PlanProblem, plan: Plan) -> str:
    """The plan as text: one row per layer, then the predicted peak of each tier against its budget,
    the step time and how the solver ended."""
    from rich.console import Console
    from rich.table import Table

    layers = Table(title=f"{plan.source} plan, {problem.num_layers} layers; grad error: measured relative L2 "
                         f"error of the layer's gradients at 8/4 bits, excluded: widths over the bound")
    for column in ("layer", "activations", "bits", "act tier", "params", "state", "state bits", "grad error 8/4",
                   "excluded"):
        layers.add_column(column)
    label = problem.machine.tier_label
    for costs, lp in zip(problem.layers, plan.layers):
        layers.add_row(costs.name, lp.act_mode, str(lp.act_bits), label(lp.act_tier), label(lp.param_tier),
                       label(lp.state_tier), "8" if lp.state_8bit else "32", *_quality_cells(costs))
    tiers = Table(title="predicted peak memory per tier")
    for column in ("tier", "peak GB", "budget GB", "used"):
        tiers.add_column(column, justify="right")
    for name, tier in problem.machine.tiers.items():
        peak = plan.predicted_peak_bytes.get(name, 0.0)
        tiers.add_row(label(name), f"{peak / GB:.2f}", f"{tier.capacity_bytes / GB:.2f}",
                      f"{100 * peak / tier.capacity_bytes:.1f}%" if tier.capacity_bytes else "-")
    buffer = io.StringIO()
    console = Console(file=buffer, width=TABLE_WIDTH, force_terminal=False, color_system=None)
    console.print(layers)
    console.print(tiers)
    console.print(f"predicted step time {plan.predicted_step_s:.3f} s, solved in {plan.solve_s:.2f} s, "
                  f"gap {100 * plan.gap:.2f}%, status {plan.status}")
    if problem.machine.paths:
        speeds = [f"{name} {path.bytes_per_s / GB:.2f} GB/s" for name, path in problem.machine.paths.items()]
        if problem.machine.nvme_param_bytes_per_s is not None:
            speeds.append(f"nvme_parameters {problem.machine.nvme_param_bytes_per_s / GB:.2f} GB/s")
        console.print("copy speeds priced: " + ", ".join(speeds))
    return buffer.getvalue()


def _quality_cells(costs: LayerCosts) -> tuple[str, str]:
    """The layer's measured gradient errors at 8 and 4 bits ("-": not measured) and the widths its
    error bound excludes ("-": none)."""
    errors = "-" if costs.grad_error is None else "/".join(f"{costs.grad_error[b]:.4f}" for b in REDUCED_WIDTHS)
    excluded = [str(b) for b in BIT_WIDTHS if b not in costs.act_widths]
    return errors, ",".join(excluded) or "-"


def baseline_step_times(problem: PlanProblem, greedy: Plan | None = None) -> dict[str, str]:
    """Predicted step time of each baseline, or why it does not fit. `greedy`: the greedy plan when
    the caller already has it (it is the solver's warm start)."""
    makers = {
        "greedy": lambda: greedy if greedy is not None else greedy_plan(problem),
        f"fixed rule (k={FIXED_RULE_K})": lambda: fixed_rule_plan(problem, FIXED_RULE_K),
        "DeepSpeed default": lambda: deepspeed_default_plan(problem),
    }
    results = {}
    for name, make in makers.items():
        try:
            plan = make()
            check_within_budgets(problem, plan)
        except (PlanInfeasible, BudgetExceeded) as error:
            results[name] = f"infeasible: {error}"
            continue
        results[name] = f"{plan.predicted_step_s:.3f} s"
    return results


def plot_memory(problem: PlanProblem, plan: Plan, path: str | FilePath) -> None:
    """PNG of each tier's memory over the step's windows (simulated), budgets dashed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    simulation = simulate(problem, plan)
    figure = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    windows = range(problem.num_windows)
    for tier, spec in problem.machine.tiers.items():
        line, = axes.plot(windows, [r.memory.get(tier, 0.0) / GB for r in simulation.windows],
                          label=problem.machine.tier_label(tier))
        axes.axhline(spec.capacity_bytes / GB, color=line.get_color(), linestyle="--", linewidth=1)
    ticks = list(windows)[:: max(1, problem.num_windows // 20)]
    axes.set_xticks(ticks, [window_label(problem, w) for w in ticks])
    axes.set_xlabel("window (f: forward, b: backward, opt: optimizer)")
    axes.set_ylabel("GB")
    axes.set_ylim(bottom=0)
    axes.set_title(f"{plan.source} plan: predicted step {plan.predicted_step_s:.3f} s (budgets dashed)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
