"""The release gate: capabilities whose config exists but whose runtime has not landed yet.

Switching one on is rejected rather than silently ignored. Each row names the issue that brings
the capability; that issue deletes its row.
"""

from __future__ import annotations

from lazyzero._version import __version__
from lazyzero.config.errors import Problem, render_value
from lazyzero.config.models import LazyZeroConfig

# key path inside the "lazyzero" section -> (the only value allowed for now, issue that implements it)
NOT_YET_AVAILABLE: dict[str, tuple[object, int]] = {}


def release_gate_problems(config: LazyZeroConfig) -> list[Problem]:
    """One problem per capability switched on before its runtime exists."""
    gated = [(key_path, allowed, f"issue {issue}") for key_path, (allowed, issue) in NOT_YET_AVAILABLE.items()]
    problems = []
    for key_path, value_allowed_now, why in gated:
        section, field = key_path.split(".")
        value = getattr(getattr(config, section), field)
        if value != value_allowed_now:
            problems.append(Problem(
                f"lazyzero.{key_path}",
                f"got {render_value(value)}; not available in lazyzero {__version__} yet ({why}); "
                f"allowed now: {render_value(value_allowed_now)}"))
    return problems
