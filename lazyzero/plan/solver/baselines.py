"""Baseline plans the MILP is compared with (docs/plan.md). Neither checks budgets: run
`simulate.check_within_budgets` on them, a baseline that overflows is a finding, not an error."""

from __future__ import annotations

from lazyzero.plan.solver.problem import RECOMPUTE, LayerPlan, Placement, Plan, PlanProblem, widest_activation
from lazyzero.plan.solver.simulate import evaluate_layers


def _host_tier(problem: PlanProblem) -> str:
    """Host memory, or NVMe on a machine whose compute memory is the host (the device if neither)."""
    tiers = problem.machine.tiers
    return next((t for t in ("cpu", "nvme") if t in tiers), "gpu")


def fixed_rule_plan(problem: PlanProblem, k: int) -> Plan:
    """LazyTrain's fixed rule: layers at a multiple of k keep their activations (at the widest width
    they may use, in host memory), the others recompute; parameters and fp32 optimizer state in host
    memory. The last layer keeps its activations on the device (nothing would overlap reading them back)."""
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k!r}")
    host = _host_tier(problem)
    placement = Placement(host, host, False)
    layers = []
    for i in range(problem.num_layers):
        if problem.allow_recompute and i % k != 0:
            layers.append(LayerPlan.of(RECOMPUTE, placement))
        else:
            tier = host if problem.activation_read_windows(i) else "gpu"
            layers.append(LayerPlan.of(widest_activation(problem, i, tier), placement))
    return evaluate_layers(problem, layers, "fixed_rule")


def deepspeed_default_plan(problem: PlanProblem) -> Plan:
    """ZeRO-Infinity's defaults: parameters and fp32 optimizer state offloaded to host memory (NVMe
    when they do not fit there, or when there is no host tier), no recompute, activations kept on the
    device at the widest width each layer may use."""
    total = sum(c.param_bytes + c.optim_state_bytes_fp32 + c.grad_bytes for c in problem.layers)
    tiers = problem.machine.tiers
    fits_host = problem.machine.has_host and total <= tiers["cpu"].capacity_bytes
    home = "nvme" if "nvme" in tiers and not fits_host else _host_tier(problem)
    layers = [LayerPlan.of(widest_activation(problem, i), Placement(home, home, False))
              for i in range(problem.num_layers)]
    return evaluate_layers(problem, layers, "deepspeed_default")
