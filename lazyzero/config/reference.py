"""Human-readable renderings of the config: the Markdown reference (the generated block of
docs/config.md) and a short summary of which features a validated config switches on.

Both are generated from the models, so the documentation cannot drift from the code; the output
is deterministic (fields in declaration order, no timestamps) so that a test can compare it.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from lazyzero._version import __version__
from lazyzero.config.fieldtypes import describe_allowed
from lazyzero.config.models import FEATURES, LazyZeroConfig


def config_reference_markdown() -> str:
    """One Markdown table per sub-section: key, allowed values, default, description."""
    sections = [_section_markdown(name, field.annotation) for name, field in LazyZeroConfig.model_fields.items()]
    return "\n\n".join(sections) + "\n"


def format_config_summary(config: LazyZeroConfig) -> str:
    """A few lines: which capabilities are on (each section's `enabled`)."""
    features = config.enabled_features()
    lines = [f"lazyzero {__version__}: features on: {', '.join(features) if features else 'none'}"]
    width = max(len(section) for section in FEATURES)
    lines += [f"  {section:<{width}}  {'on' if section in features else 'off'}" for section in FEATURES]
    return "\n".join(lines)


def _section_markdown(name: str, model: type[BaseModel]) -> str:
    lines = [f"### `lazyzero.{name}`", "", _one_line(model.__doc__ or "")]
    lines += ["", "| key | allowed values | default | description |", "|---|---|---|---|"]
    for field_name, field in model.model_fields.items():
        cells = [f"`{field_name}`", describe_allowed(field.annotation, tuple(field.metadata)),
                 f"`{json.dumps(field.get_default(call_default_factory=True))}`", _one_line(field.description or "")]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return " ".join(text.split())
