"""Memory planner (docs/plan.md): problem -> MILP (python-mip, CBC) -> Plan, with a greedy plan, the
baselines it is compared with, and a step simulator that checks any plan against the budgets."""

from lazyzero.plan.solver.baselines import deepspeed_default_plan, fixed_rule_plan
from lazyzero.plan.solver.greedy import greedy_plan
from lazyzero.plan.solver.milp import SolverFoundNoPlan, build_model, solve
from lazyzero.plan.solver.problem import (
                                      ActTransfer,
                                      LayerCosts,
                                      LayerPlan,
                                      Machine,
                                      Path,
                                      Plan,
                                      PlanInfeasible,
                                      PlanProblem,
                                      Tier,
)
from lazyzero.plan.solver.simulate import BudgetExceeded, StepSimulation, check_within_budgets, simulate

__all__ = [
    "ActTransfer", "BudgetExceeded", "LayerCosts", "LayerPlan", "Machine", "Path", "Plan", "PlanInfeasible",
    "PlanProblem", "SolverFoundNoPlan", "StepSimulation", "Tier", "build_model", "check_within_budgets",
    "deepspeed_default_plan", "fixed_rule_plan", "greedy_plan", "simulate", "solve",
]
