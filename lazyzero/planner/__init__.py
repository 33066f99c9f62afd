"""Memory planner (issue 7): problem -> MILP (python-mip, CBC) -> Plan, with a greedy plan, the
baselines it is compared with, and a step simulator that checks any plan against the budgets."""

from lazyzero.planner.baselines import deepspeed_default_plan, fixed_rule_plan
from lazyzero.planner.greedy import greedy_plan
from lazyzero.planner.milp import SolverFoundNoPlan, build_model, solve
from lazyzero.planner.problem import (ActTransfer, LayerCosts, LayerPlan, Machine, Path, Plan, PlanInfeasible,
                                      PlanProblem, Tier)
from lazyzero.planner.simulate import BudgetExceeded, StepSimulation, check_within_budgets, simulate

__all__ = [
    "ActTransfer", "BudgetExceeded", "LayerCosts", "LayerPlan", "Machine", "Path", "Plan", "PlanInfeasible",
    "PlanProblem", "SolverFoundNoPlan", "StepSimulation", "Tier", "build_model", "check_within_budgets",
    "deepspeed_default_plan", "fixed_rule_plan", "greedy_plan", "simulate", "solve",
]
