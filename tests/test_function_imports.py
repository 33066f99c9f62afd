"""An import inside a function is an exception (docs/architecture.md, "The layering rule"): it is for an
optional library, or keeps a heavy one off `import lazyzero`, `lazyzero --help`, `lazyzero config check`
or the pure solver. Every module such an import names is listed below, an internal one with the reason;
anything else belongs at the top of its module."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lazyzero"

# Third-party libraries, by top-level name.
LAZY_LIBRARIES = {
    # Heavy: a second or more to import, or a solver's native library.
    "torch", "deepspeed", "transformers", "mip", "numpy", "matplotlib", "rich", "tqdm",
    # Optional: installed with an extra of pyproject.toml, or by the user's own trainer.
    "accelerate", "lightning", "mpi4py",
}

# lazyzero modules (a package stands for every module under it) -> why a function imports them.
LAZY_MODULES = {
    "lazyzero.app.data": "imports transformers (tokenizers), only once a run builds its data",
    "lazyzero.checkpoint.rank_state": "imports torch; kept off `lazyzero --help` (the ckpt commands)",
    "lazyzero.checkpoint.snapshot": "imports torch; the solver stays pure (tests/plan/test_solver_is_pure.py)",
    "lazyzero.checkpoint.staged_io": "imports torch; kept off `lazyzero plan`'s problem building",
    "lazyzero.checkpoint.trainer_end": "imports transformers; routed only where a trainer is installed",
    "lazyzero.config.reference": "builds every section model (pydantic); kept off `lazyzero --help`",
    "lazyzero.config.validate": "builds every section model (pydantic); kept off `lazyzero --help`",
    "lazyzero.engine.engine": "imports DeepSpeed; kept off `import lazyzero` and `patch_deepspeed()`",
    "lazyzero.engine.features": "imports every capability and DeepSpeed; kept off `import lazyzero`",
    "lazyzero.engine.initialize": "imports torch; kept off `import lazyzero` until `initialize` is called",
    "lazyzero.models.build": "imports torch and transformers; kept off `lazyzero --help`",
    "lazyzero.models.config": "imports transformers; kept off the training application's import",
    "lazyzero.models.params": "imports transformers; kept off the training application's import",
    "lazyzero.models.pretrained": "imports transformers; kept off the training application's import",
    "lazyzero.ops": "imports torch (the op schemas); kept off `lazyzero --help` and `lazyzero env`",
    "lazyzero.patch_point": "imports DeepSpeed; kept off `import lazyzero` and `lazyzero --help`",
    "lazyzero.plan.deepspeed.engine_setup": "imports DeepSpeed and transformers; kept off the feature registry",
    "lazyzero.plan.deepspeed.monitor": "imports torch; kept off the feature registry",
    "lazyzero.plan.deepspeed.zero_placement": "imports DeepSpeed; a calibration child (`python -m`) starts without it",
    "lazyzero.plan.profile.layers": "imports DeepSpeed and transformers; a calibration child starts without them",
    "lazyzero.plan.profile.profiler": "imports torch and DeepSpeed; kept off `lazyzero --help`",
    "lazyzero.plan.solver.milp": "imports mip (the MILP solver); loaded when a plan is solved, not for `--help`",
    "lazyzero.safe_load": "imports torch; kept off `lazyzero --help` (the ckpt commands)",
    "lazyzero.train": "imports torch and transformers; kept off `lazyzero --help`",
}


def _module_names() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _lazy_homes(package: str) -> dict[str, str]:
    """A package face's names resolved on first use (lazyzero/_lazy_names.py): name -> home module."""
    try:
        homes = getattr(importlib.import_module(package), "_HOMES", {})
    except ImportError:
        return {}
    return {name: f"{package}.{home}" for name, home in homes.items()}


def function_imports(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every import inside a function of `path`; a name imported from a package is
    its submodule, or the home module of a name the package resolves on first use."""
    own = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = own if path.name == "__init__.py" else own[:-1]
    found = []
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                found += [(node.lineno, alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ((node.module,) if node.module else ())) \
                    if node.level else node.module
                homes = _lazy_homes(base) if base in modules else {}
                found += [(node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules
                           else homes.get(alias.name, base)) for alias in node.names]
    return found


def allowed(module: str) -> bool:
    if not module.startswith("lazyzero"):
        return module.split(".")[0] in LAZY_LIBRARIES
    return any(module == name or module.startswith(f"{name}.") for name in LAZY_MODULES)


def every_function_import() -> list[tuple[str, int, str]]:
    modules = _module_names()
    return [(str(path.relative_to(PACKAGE.parent)), line, module)
            for path in sorted(PACKAGE.rglob("*.py")) for line, module in function_imports(path, modules)]


def test_imports_inside_functions_are_listed_exceptions():
    unlisted = [f"{path}:{line} imports {module}" for path, line, module in every_function_import()
                if not allowed(module)]
    assert not unlisted, ("imports inside functions of modules neither optional nor heavy (move them to the top "
                          "of the module, or list them here with the reason):\n" + "\n".join(unlisted))


def test_every_listed_module_is_still_imported_late():
    """The list shrinks with the code: an entry no function import needs any more is removed."""
    imported = {module for _, _, module in every_function_import()}
    stale = [name for name in LAZY_MODULES
             if not any(module == name or module.startswith(f"{name}.") for module in imported)]
    assert not stale, f"listed but imported at module level everywhere: {stale}"


@pytest.mark.parametrize("text,expected", [
    ("def f():\n    import json\n", [(2, "json")]),
    ("def f():\n    from lazyzero.plan.solver import greedy\n", [(2, "lazyzero.plan.solver.greedy")]),
    ("def f():\n    from lazyzero.plan import PlanInfeasible\n", [(2, "lazyzero.plan.solver.problem")]),
    ("def f():\n    from . import layers\n", [(2, "lazyzero.plan.profile.layers")]),
    ("class A:\n    def f(self):\n        from torch import nn\n", [(3, "torch")]),
    ("import json\n", []),
])
def test_the_checker_finds_every_import_inside_a_function(tmp_path, monkeypatch, text, expected):
    """The test above can fail: each form of a late import is found, and a bogus one is not allowed."""
    root = tmp_path / "lazyzero"
    path = root / "plan" / "profile" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    monkeypatch.setattr(f"{__name__}.PACKAGE", root)
    modules = _module_names() | {"lazyzero.plan", "lazyzero.plan.solver", "lazyzero.plan.solver.greedy",
                                 "lazyzero.plan.solver.problem", "lazyzero.plan.profile.layers"}
    assert function_imports(path, modules) == expected
    if expected and expected[0][1] == "json":
        assert not allowed("json")
