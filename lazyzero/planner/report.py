"""What `lazyzero plan` shows and writes (issue 7): the plan as a table, the DeepSpeed config it
implies, a plot of memory per tier over the step, and the baselines' predictions beside it."""

from __future__ import annotations

import copy
import io
from collections import Counter
from pathlib import Path as FilePath

from lazyzero.config.models import ActivationsConfig
from lazyzero.planner.baselines import deepspeed_default_plan, fixed_rule_plan
from lazyzero.planner.costs import decoder_layer_index
from lazyzero.planner.greedy import greedy_plan
from lazyzero.planner.problem import Plan, PlanInfeasible, PlanProblem
from lazyzero.planner.simulate import BudgetExceeded, check_within_budgets, simulate, window_label

GB = 1e9
TABLE_WIDTH = 110
# Layers between the activations LazyTrain's fixed rule keeps (its paper's default).
FIXED_RULE_K = 4
DEFAULT_BASE_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True}}
_ACTIVATION_DEFAULTS = ActivationsConfig()


def plan_table(problem: PlanProblem, plan: Plan) -> str:
    """The plan as text: one row per layer, then the predicted peak of each tier against its budget,
    the step time and how the solver ended."""
    from rich.console import Console
    from rich.table import Table

    layers = Table(title=f"{plan.source} plan, {problem.num_layers} layers")
    for column in ("layer", "activations", "bits", "act tier", "params", "state", "state bits"):
        layers.add_column(column)
    for costs, lp in zip(problem.layers, plan.layers):
        layers.add_row(costs.name, lp.act_mode, str(lp.act_bits), lp.act_tier, lp.param_tier, lp.state_tier,
                       "8" if lp.state_8bit else "32")
    tiers = Table(title="predicted peak memory per tier")
    for column in ("tier", "peak GB", "budget GB", "used"):
        tiers.add_column(column, justify="right")
    for name, tier in problem.machine.tiers.items():
        peak = plan.predicted_peak_bytes.get(name, 0.0)
        tiers.add_row(name, f"{peak / GB:.2f}", f"{tier.capacity_bytes / GB:.2f}",
                      f"{100 * peak / tier.capacity_bytes:.1f}%" if tier.capacity_bytes else "-")
    buffer = io.StringIO()
    console = Console(file=buffer, width=TABLE_WIDTH, force_terminal=False, color_system=None)
    console.print(layers)
    console.print(tiers)
    console.print(f"predicted step time {plan.predicted_step_s:.3f} s, solved in {plan.solve_s:.2f} s, "
                  f"gap {100 * plan.gap:.2f}%, status {plan.status}")
    return buffer.getvalue()


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


def _home_tier(byte_counts: Counter) -> str:
    """The tier holding most of these bytes (ZeRO-3 offloads all of a kind of tensor, or none)."""
    return max(byte_counts, key=byte_counts.get) if byte_counts else "gpu"


def _offload_section(tier: str, nvme_path: str | None) -> dict:
    if tier == "gpu":
        return {"device": "none"}
    if tier == "cpu":
        return {"device": "cpu", "pin_memory": True}
    if nvme_path is None:
        raise ValueError("the plan offloads to NVMe: implied_ds_config needs nvme_path")
    return {"device": "nvme", "nvme_path": nvme_path}


def _zero_section(problem: PlanProblem, plan: Plan, nvme_path: str | None) -> dict:
    params, states = Counter(), Counter()
    for costs, lp in zip(problem.layers, plan.layers):
        params[lp.param_tier] += costs.param_bytes
        states[lp.state_tier] += costs.state_bytes(lp.state_8bit)
    return {"stage": 3, "offload_param": _offload_section(_home_tier(params), nvme_path),
            "offload_optimizer": _offload_section(_home_tier(states), nvme_path)}


def _width_overrides(layer: int, bits: int, default_bits: int) -> dict[str, int]:
    """Overrides giving decoder layer `layer` the analytic model's widths when they differ from the
    default. An override outranks attention_bits and norm_bits (lazyzero/activations/policy.py), so
    a quantized layer names its MLP and norms only, keeping attention at 16 bits and norms at
    norm_bits or more, as the costs assume."""
    if bits == default_bits:
        return {}
    if bits == 16:
        return {f"model.layers.{layer}.*": 16}
    return {f"model.layers.{layer}.mlp": bits,
            f"model.layers.{layer}.*layernorm": max(bits, _ACTIVATION_DEFAULTS.norm_bits)}


def _activations_section(problem: PlanProblem, plan: Plan) -> dict | None:
    """Recomputed layers and per-layer widths of the decoder layers; None when the plan keeps every
    activation at 16 bits (the feature would only add hooks). Where activations live is not a
    config setting yet; the plan.json says it."""
    recompute, kept = [], {}
    for costs, lp in zip(problem.layers, plan.layers):
        layer = decoder_layer_index(costs.name)
        if layer is None:
            continue
        if lp.act_mode == "recompute":
            recompute.append(layer)
        else:
            kept[layer] = lp.act_bits
    if not recompute and all(bits == 16 for bits in kept.values()):
        return None
    # The most common width becomes the default, so that the overrides name only the exceptions.
    default_bits = Counter(kept.values()).most_common(1)[0][0] if kept else 16
    overrides = {}
    for layer, bits in kept.items():
        overrides.update(_width_overrides(layer, bits, default_bits))
    return {"enabled": True, "default_bits": default_bits, "recompute_layers": recompute, "overrides": overrides}


def eight_bit_share(problem: PlanProblem, plan: Plan) -> float:
    """Share of the possible 8-bit state saving the plan takes. Every eligible element saves the same
    bytes, so this is the share of eligible elements, i.e. OptimizerConfig.fraction_8bit. The runtime
    picks the largest tensors first rather than these layers: same total, different tensors."""
    savings = [c.optim_state_bytes_fp32 - c.optim_state_bytes_8bit for c in problem.layers]
    taken = sum(s for s, lp in zip(savings, plan.layers) if lp.state_8bit)
    return round(taken / sum(savings), 4) if sum(savings) > 0 else 0.0


def implied_ds_config(problem: PlanProblem, plan: Plan, base: dict | None = None, *,
                      nvme_path: str | None = None) -> dict:
    """`base` (default: a bf16 micro-batch-1 config) with the ZeRO-3 offload settings and the
    "lazyzero" activations/optimizer sections this plan implies. `nvme_path` is required when most
    parameters or optimizer states live on NVMe."""
    config = copy.deepcopy(DEFAULT_BASE_CONFIG if base is None else base)
    config.setdefault("zero_optimization", {}).update(_zero_section(problem, plan, nvme_path))
    section = config.setdefault("lazyzero", {})
    activations = _activations_section(problem, plan)
    if activations is not None:
        section["activations"] = {**section.get("activations", {}), **activations}
    if any(lp.state_8bit for lp in plan.layers):
        base_type = str(config.get("optimizer", {}).get("type", "adamw")).lower()
        section["optimizer"] = {**section.get("optimizer", {}), "type": "adam8bit" if base_type == "adam" else "adamw8bit",
                                "fraction_8bit": eight_bit_share(problem, plan)}
    return config


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
        line, = axes.plot(windows, [r.memory.get(tier, 0.0) / GB for r in simulation.windows], label=tier)
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
