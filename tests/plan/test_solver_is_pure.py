"""The planner's optimisation (lazyzero/plan/solver/) stands apart from any run: none of its modules
imports torch or DeepSpeed, at any depth, and outside the sub-package it reaches only the standard
library, python-mip and the one lazy import below; so a plan is built, solved and checked in
milliseconds on any machine (docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SOLVER = Path(__file__).resolve().parents[2] / "lazyzero" / "plan" / "solver"
THIRD_PARTY = {"mip"}
# Called only for a problem with a lazy checkpoint's snapshot; the function is arithmetic, its module
# holds the snapshot buffers (docs/checkpoint.md, "Memory").
LAZY_OUTSIDE = {("problem.py", "lazyzero.checkpoint.snapshot")}


def imported_modules(path: Path) -> set[str]:
    """Absolute module names `path` imports, at any depth (relative imports resolved)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ("lazyzero", "plan", "solver")[:3 - (node.level - 1)]
                found.add(".".join(base + ((node.module,) if node.module else ())))
            else:
                found.add(node.module or "")
    return found


def test_solver_modules_import_only_the_standard_library_mip_and_each_other():
    outside = []
    for path in sorted(SOLVER.glob("*.py")):
        for module in imported_modules(path):
            top = module.split(".")[0]
            if module == "__future__" or top in sys.stdlib_module_names or top in THIRD_PARTY:
                continue
            if module.startswith("lazyzero.plan.solver") or (path.name, module) in LAZY_OUTSIDE:
                continue
            outside.append(f"{path.name} -> {module}")
    assert not outside, "lazyzero/plan/solver/ reaches outside the optimisation:\n" + "\n".join(outside)


def test_solving_a_plan_loads_neither_torch_nor_deepspeed():
    code = ("import sys\n"
            "from lazyzero.plan.solver.baselines import deepspeed_default_plan\n"
            "from lazyzero.plan.solver.instances import llama_like_80_layers\n"
            "from lazyzero.plan.solver.milp import build_model\n"
            "from lazyzero.plan.solver.simulate import simulate\n"
            "problem = llama_like_80_layers()\n"
            "simulate(problem, deepspeed_default_plan(problem))\n"
            "build_model(problem)\n"
            "print(sorted(name for name in ('torch', 'deepspeed') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
