"""How configuration problems are worded and raised (docs/reliability.md, guarantee 6: key path, value,
what is allowed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Optional

# Long values (a whole sub-section given where a number was expected) are cut so that each
# problem stays on one readable line.
_MAX_VALUE_CHARS = 60


def render_value(value: Any) -> str:
    """A value as the user wrote it: strings quoted like Python ('int8'), everything else as JSON
    (true, null, [1, 2])."""
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = repr(value)
    if len(text) > _MAX_VALUE_CHARS:
        text = text[: _MAX_VALUE_CHARS - 3] + "..."
    return text


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config: where (`path`, e.g. `lazyzero.plan.gpu_mem`) and what (`text`)."""

    path: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}: {self.text}"

    @classmethod
    def bad_value(cls, path: str, value: Any, allowed: str) -> Problem:
        return cls(path, f"got {render_value(value)}; allowed: {allowed}")

    @classmethod
    def missing(cls, path: str, allowed: str) -> Problem:
        return cls(path, f"got nothing; allowed: {allowed}")

    @classmethod
    def conflict(cls, path: str, value: Any, allowed: str, because: str) -> Problem:
        """A value that is fine on its own but contradicts the DeepSpeed settings around it."""
        return cls(path, f"got {render_value(value)}; allowed: {allowed} "
                         f"(conflict with the DeepSpeed settings around it: {because})")


class LazyZeroConfigError(ValueError):
    """A DeepSpeed/lazyzero config was rejected. The message lists every problem found, one per line.

    `problems` holds the same lines, one string each, for programs that want them separately.
    """

    def __init__(self, problems: Iterable[Problem], source: Optional[str] = None):
        self.problems = [str(problem) for problem in problems]
        self.source = source
        count = len(self.problems)
        where = f" in {source}" if source else ""
        header = f"invalid DeepSpeed/lazyzero config{where} ({count} problem{'s' if count != 1 else ''}):"
        super().__init__("\n".join([header, *self.problems]))
