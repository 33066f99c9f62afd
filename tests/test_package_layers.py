"""The package map holds (docs/architecture.md): foundation packages import no capability, capability
packages import neither the engine, the application nor the test helpers, and no two capability
packages import each other in a cycle. Every import counts, also those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lazyzero"
FOUNDATION = {"config", "ops", "distributed", "models", "docs", "patch_point", "safe_load", "feature", "_version",
              "_lazy_names"}
CAPABILITIES = {"gradients", "optimizer", "activations", "checkpoint", "plan"}
LAYER = {**{name: 0 for name in FOUNDATION}, **{name: 1 for name in CAPABILITIES}, "engine": 2,
         "app": 3, "train": 3, "cli": 3, "testing": 4,
         # The public API (`lazyzero.initialize`, ...) resolves its names lazily from the engine.
         "__init__": 5}


def top_package(module: str) -> str | None:
    parts = module.split(".")
    if parts[:1] == ["lazyzero"] and len(parts) > 2 and parts[1] in CAPABILITIES and parts[2] == "config":
        return "config"  # a capability's section module is part of the foundation `config` (section_module)
    return parts[1] if parts[0] == "lazyzero" and len(parts) > 1 else ("__init__" if module == "lazyzero" else None)


def imports_of(path: Path) -> set[str]:
    """Top-level lazyzero packages `path` imports (absolute and relative imports, at any depth)."""
    tree = ast.parse(path.read_text(), str(path))
    found = set()
    own = path.relative_to(PACKAGE.parent).with_suffix("").parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(filter(None, (top_package(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own[:len(own) - node.level]
                module = ".".join(base + ((node.module,) if node.module else ()))
            else:
                module = node.module or ""
            top = top_package(module)
            if module == "lazyzero":
                # `from lazyzero import x`: the module x, or else a name of the package face itself.
                found.update(alias.name if _is_module(alias.name) else "__init__" for alias in node.names)
            elif top:
                found.add(top)
    return found


def _is_module(name: str) -> bool:
    return (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def package_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if section_module(relative):
        return "config"
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def section_module(relative: Path) -> bool:
    """`<capability>/config.py`: the capability's config section and its checks, which `lazyzero.config`
    composes into `LazyZeroConfig`; it sits on the foundation layer with config/ and imports only from there
    (docs/architecture.md, "The layering rule")."""
    return len(relative.parts) == 2 and relative.parts[0] in CAPABILITIES and relative.parts[1] == "config.py"


def import_graph() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the files of `package` that import it."""
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = package_of(path)
        for target in imports_of(path) - {source}:
            graph.setdefault(source, {}).setdefault(target, set()).add(str(path.relative_to(PACKAGE.parent)))
    return graph


def test_every_package_is_on_the_map():
    packages = {package_of(path) for path in PACKAGE.rglob("*.py")}
    assert packages <= set(LAYER), f"not in LAYER (docs/architecture.md): {sorted(packages - set(LAYER))}"


def test_no_package_imports_upward():
    upward = [f"{source} -> {target} ({', '.join(sorted(files))})"
              for source, targets in import_graph().items() for target, files in targets.items()
              if LAYER[target] > LAYER[source]]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_capability_packages_import_each_other_without_cycles():
    graph = {source: {t for t in targets if t in CAPABILITIES}
             for source, targets in import_graph().items() if source in CAPABILITIES}

    def cycle_from(start, node, seen):
        for nxt in graph.get(node, ()):
            if nxt == start:
                return seen + [nxt]
            if nxt not in seen:
                found = cycle_from(start, nxt, seen + [nxt])
                if found:
                    return found
        return None

    cycles = [cycle for start in graph if (cycle := cycle_from(start, start, [start]))]
    assert not cycles, f"import cycles between capability packages: {cycles}"


@pytest.mark.parametrize("source,text,expected", [
    ("lazyzero/plan/x.py", "from lazyzero.engine import engine", {"engine"}),
    ("lazyzero/plan/x.py", "def f():\n    import lazyzero.testing\n", {"testing"}),
    ("lazyzero/plan/profile/x.py", "from ...engine import initialize", {"engine"}),
    ("lazyzero/plan/x.py", "from lazyzero import testing, config", {"testing", "config"}),
    ("lazyzero/plan/x.py", "from lazyzero import __version__", {"__init__"}),
    ("lazyzero/config/x.py", "from lazyzero.gradients.config import GradientsConfig", {"config"}),
    ("lazyzero/config/x.py", "from lazyzero.gradients.exchange import GradientExchange", {"gradients"}),
])
def test_the_checker_sees_every_form_of_import(tmp_path, monkeypatch, source, text, expected):
    """The test above can fail: each import form is found."""
    root = tmp_path / "lazyzero"
    path = tmp_path / source
    path.parent.mkdir(parents=True)
    path.write_text(text)
    for name in ("engine", "testing.py", "config"):
        (root / name).mkdir(parents=True, exist_ok=True) if "." not in name else (root / name).touch()
    monkeypatch.setattr(f"{__name__}.PACKAGE", root)
    assert imports_of(path) - {"plan"} == expected


def test_a_capability_section_module_is_foundation():
    """The one exception to "a package is its top folder": `gradients/config.py` counts as `config`."""
    assert package_of(PACKAGE / "gradients" / "config.py") == "config"
    assert package_of(PACKAGE / "gradients" / "exchange.py") == "gradients"


def test_the_engine_names_no_capability():
    """LazyZeroEngine reaches the capabilities only through the feature registry
    (lazyzero/engine/features.py): its module imports no capability package and reads no section."""
    engine = PACKAGE / "engine" / "engine.py"
    assert not imports_of(engine) & CAPABILITIES
    text = engine.read_text()
    named = [section for section in CAPABILITIES
             if f"lazyzero_config.{section}" in text or f'section("{section}")' in text]
    assert not named, f"engine.py names {named}"


def test_the_planner_profile_does_not_import_the_engine_setup():
    """The engine setup profiles a model (lazyzero/plan/deepspeed/engine_setup.py imports
    lazyzero/plan/profile/); the profile reads nothing back from it, not even inside a function,
    so the two are not a cycle."""
    back = []
    for path in sorted((PACKAGE / "plan" / "profile").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{alias.name}" for alias in node.names] + [node.module or ""]
                     if isinstance(node, ast.ImportFrom) else [])
            back += [f"{path.name} -> {name}" for name in names if name == "lazyzero.plan.deepspeed.engine_setup"]
    assert not back, f"plan/profile/ imports the engine setup: {back}"


def module_graph() -> dict[str, set[str]]:
    """lazyzero module -> the lazyzero modules it imports (a package counts as its __init__), every
    import counted, also those inside functions."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(alias.name) for alias in node.names if alias.name.startswith("lazyzero"))
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]).rstrip(".") \
                    if node.level else (node.module or "")
                if base.startswith("lazyzero"):
                    targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else resolve(base)
                                   for a in node.names)
        graph[name] = targets - {name, None}
    return graph


def test_no_module_imports_itself_back_through_others():
    """A cycle hidden by an import inside a function is still a cycle (docs/architecture.md)."""
    graph = module_graph()

    def path_back(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for target in graph.get(node, ()):
                if target == start:
                    return path + [start]
                if target not in seen:
                    seen.add(target)
                    stack.append((target, path + [target]))
        return None

    cycles = [cycle for start in sorted(graph) if (cycle := path_back(start))]
    assert not cycles, "import cycles between modules:\n" + "\n".join(" -> ".join(c) for c in cycles[:5])
