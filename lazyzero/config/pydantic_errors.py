"""Pydantic's validation errors, reworded as lazyzero problems: key path, value given, what is allowed.

Pydantic's own wording ("Input should be a valid integer") names neither the full key path nor,
for custom checks, what would have been accepted. The error's `loc` gives the path; the allowed
text comes from the field's annotation (`describe_allowed`), so it states the whole rule, not
only the part that failed. A key or value a model has retired (`ConfigSection.retired_keys`,
`retired_values`) gets the model's hint naming what to write instead.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from lazyzero.config.errors import Problem
from lazyzero.config.fieldtypes import describe_allowed, item_annotation, model_keys_text, unwrap_optional


@dataclass
class _Location:
    """Where an error's `loc` points: the key path, and the type (or model) expected there."""

    path: str
    annotation: Any
    metadata: tuple = ()
    unknown_key_of: Optional[type[BaseModel]] = None
    retired_values: Optional[dict] = None
    """Values this field no longer takes -> hint (the owning model's `retired_values` entry)."""


def problems_from_validation_error(error: ValidationError, root: type[BaseModel], root_path: str) -> list[Problem]:
    """One problem per pydantic error, in pydantic's order (the order of the fields)."""
    return [_problem(detail, _locate(root, root_path, detail["loc"])) for detail in error.errors()]


def _problem(detail: dict, location: _Location) -> Problem:
    if location.unknown_key_of is not None:
        return _unknown_key(location.path, location.unknown_key_of)
    allowed = describe_allowed(location.annotation, location.metadata)
    hint = _retired_value_hint(location.retired_values or {}, detail["input"])
    return Problem.bad_value(location.path, detail["input"], f"{allowed} ({hint})" if hint else allowed)


def _retired_value_hint(retired: dict, value: Any) -> Optional[str]:
    # Compared with its type too: JSON's 1 and true are different values, though Python's == says otherwise.
    return next((hint for old, hint in retired.items() if type(old) is type(value) and old == value), None)


def _unknown_key(path: str, model: type[BaseModel]) -> Problem:
    key = path.rsplit(".", 1)[-1]
    retired = getattr(model, "retired_keys", {})
    if key in retired:
        return Problem(path, f"removed; {retired[key]}")
    text = f"unknown key; allowed keys: {model_keys_text(model)}"
    # Compare lowercased so "Plan" and "GPU_mem" are recognised as well as transposed letters.
    by_lower = {name.lower(): name for name in model.model_fields}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    if close:
        text += f"; did you mean {by_lower[close[0]]!r}?"
    return Problem(path, text)


def _locate(root: type[BaseModel], root_path: str, loc: tuple) -> _Location:
    """Walk `loc` through the model tree: field names through models, then indices and dict keys."""
    location = _Location(root_path, root)
    model: Optional[type[BaseModel]] = root
    for index, part in enumerate(loc):
        if part == "[key]":
            # Pydantic's marker after a dict key that is itself invalid; the path already names the key.
            continue
        if model is not None:
            if part not in model.model_fields:
                return _Location(f"{location.path}.{part}", None, unknown_key_of=model)
            field = model.model_fields[part]
            location = _Location(f"{location.path}.{part}", field.annotation, tuple(field.metadata),
                                 retired_values=getattr(model, "retired_values", {}).get(part))
            model = _model_class(field.annotation)
        else:
            is_bad_key = loc[index + 1:index + 2] == ("[key]",)
            step = f"[{part}]" if isinstance(part, int) else f"[{part!r}]"
            location = _Location(location.path + step, item_annotation(location.annotation, dict_key=is_bad_key))
    return location


def _model_class(annotation: Any) -> Optional[type[BaseModel]]:
    annotation = unwrap_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None
