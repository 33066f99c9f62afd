"""Memory planner (docs/plan.md): problem -> MILP (python-mip, CBC) -> Plan, with a greedy plan, the
baselines it is compared with, and a step simulator that checks any plan against the budgets.

The names below live in `lazyzero.plan.solver` and are resolved on first use (PEP 562), so that the
command line's help does not load the MILP solver."""

import importlib

_WHERE = {
    "deepspeed_default_plan": "baselines", "fixed_rule_plan": "baselines",
    "greedy_plan": "greedy",
    "SolverFoundNoPlan": "milp", "build_model": "milp", "solve": "milp",
    "ActTransfer": "problem", "LayerCosts": "problem", "LayerPlan": "problem", "Machine": "problem", "Path": "problem",
    "Plan": "problem", "PlanInfeasible": "problem", "PlanProblem": "problem", "Tier": "problem",
    "BudgetExceeded": "simulate", "StepSimulation": "simulate", "check_within_budgets": "simulate",
    "simulate": "simulate",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'lazyzero.plan' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lazyzero.plan.solver.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
