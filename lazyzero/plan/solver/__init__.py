"""The planner's optimisation, apart from any run (docs/plan.md, "How it works", steps 2-3): the
problem (`problem.py`), the MILP that solves it (`milp.py`, `milp_transfers.py`), the greedy plan that
warm-starts it (`greedy.py`), the step simulator that checks any plan against the budgets
(`simulate.py`), the baselines (`baselines.py`) and small instances (`instances.py`).

Nothing here imports torch or DeepSpeed (tests/plan/test_solver_is_pure.py), so a plan can be
built, solved and checked in milliseconds on any machine."""
