"""Memory planner (docs/plan.md): problem -> MILP (python-mip, CBC) -> Plan, with a greedy plan, the
baselines it is compared with, and a step simulator that checks any plan against the budgets.

The names below live in `lazyzero.plan.solver` and are resolved on first use (PEP 562), so that the
command line's help does not load the MILP solver."""

from lazyzero._lazy_names import lazy_names

_HOMES = {
    **dict.fromkeys(("deepspeed_default_plan", "fixed_rule_plan"), "solver.baselines"),
    "greedy_plan": "solver.greedy",
    **dict.fromkeys(("SolverFoundNoPlan", "build_model", "solve"), "solver.milp"),
    **dict.fromkeys(("ActTransfer", "LayerCosts", "LayerPlan", "Machine", "Path", "Plan", "PlanInfeasible",
                     "PlanProblem", "Tier"), "solver.problem"),
    **dict.fromkeys(("BudgetExceeded", "StepSimulation", "check_within_budgets", "simulate"), "solver.simulate"),
}

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = sorted(_HOMES)
