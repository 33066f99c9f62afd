"""Field types shared by the config models, and `describe_allowed`, which words what a field accepts.

The same wording serves error messages ("allowed: an integer from 1 to 64") and the reference table
in the README, so both are derived from the type annotations and can never disagree with them.
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field
from pydantic.fields import FieldInfo

from lazyzero.config.errors import render_value
from lazyzero.config.memory import MEMORY_SIZE_ALLOWED, parse_memory_size


@dataclass(frozen=True)
class Described:
    """Annotated metadata: how to word what a custom-validated type accepts."""

    allowed: str


def _check_power_of_two(value: int) -> int:
    if value & (value - 1):
        raise ValueError(f"{value} is not a power of two")
    return value


def PowerOfTwo(low: int, high: int) -> Any:
    """An int that is a power of two in [low, high] (block sizes: one scale per block, aligned loads)."""
    return Annotated[int, Field(ge=low, le=high), AfterValidator(_check_power_of_two),
                     Described(f"a power of two from {low} to {high}")]


MemorySize = Annotated[int, BeforeValidator(parse_memory_size), Described(MEMORY_SIZE_ALLOWED)]
"""A positive byte count; accepts the strings `parse_memory_size` understands."""


def MemorySizeAtLeast(low: int, why: str) -> Any:
    """A MemorySize of at least `low` bytes (`why`: what needs that much)."""
    return Annotated[int, BeforeValidator(parse_memory_size), Field(ge=low),
                     Described(f"{MEMORY_SIZE_ALLOWED.replace('a byte count > 0', f'a byte count >= {low} ({why})')}")]


NonEmptyStr = Annotated[str, Field(min_length=1)]


def _check_distinct(values: list) -> list:
    if len(set(values)) != len(values):
        raise ValueError("the list repeats an item")
    return values


LayerIndices = Annotated[list[Annotated[int, Field(ge=0)]], AfterValidator(_check_distinct),
                         Described("a list of distinct layer indices (integers >= 0)")]


_DECIMAL_INDEX = re.compile(r"0|[1-9][0-9]*")
LAYER_KEY_ALLOWED = "a layer index as a decimal string ('0', '3', ...)"


def _parse_layer_key(value: Any) -> int:
    """A layer index from a JSON object key ("3"); Python callers (the planner) may pass the int itself.

    Only the canonical spelling is accepted: "03" or " 3" next to "3" would name one layer twice.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _DECIMAL_INDEX.fullmatch(value):
        return int(value)
    raise ValueError(f"{value!r} is not a layer index; allowed: {LAYER_KEY_ALLOWED}")


LayerKey = Annotated[int, BeforeValidator(_parse_layer_key), Described(LAYER_KEY_ALLOWED)]
"""A decoder-layer index used as an object key (JSON keys are strings)."""


def describe_allowed(annotation: Any, metadata: tuple = ()) -> str:
    """What a value of `annotation` (with pydantic/annotated-types `metadata`) may be, in words."""
    if get_origin(annotation) is Annotated:
        inner, *extra = get_args(annotation)
        return describe_allowed(inner, (*metadata, *extra))
    metadata = _flatten(metadata)
    for item in metadata:
        if isinstance(item, Described):
            return item.allowed
    if _is_optional(annotation):
        (inner,) = [arg for arg in get_args(annotation) if arg is not type(None)]
        return f"{describe_allowed(inner, metadata)}, or null"
    return _describe_plain(annotation, metadata)


def unwrap_optional(annotation: Any) -> Any:
    """`X` for `X | None` (and for `Annotated[X, ...] | None`, X with its metadata); else unchanged."""
    if _is_optional(annotation):
        (annotation,) = [arg for arg in get_args(annotation) if arg is not type(None)]
    return annotation


def item_annotation(annotation: Any, *, dict_key: bool = False) -> Any:
    """The annotation of one item of a list field, one value of a dict field, or (dict_key) one dict key."""
    annotation = unwrap_optional(annotation)
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    args = get_args(annotation)
    return args[0] if dict_key else args[-1]


def model_keys_text(model: type[BaseModel]) -> str:
    return ", ".join(sorted(model.model_fields))


def _describe_plain(annotation: Any, metadata: tuple) -> str:
    origin = get_origin(annotation)
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer" + _bounds_text(metadata)
    if annotation is float:
        return "a number" + _bounds_text(metadata)
    if annotation is str:
        too_short = any(isinstance(item, annotated_types.MinLen) and item.min_length > 0 for item in metadata)
        return "a non-empty string" if too_short else "a string"
    if origin is Literal:
        return "one of " + ", ".join(render_value(choice) for choice in get_args(annotation))
    if origin is list:
        return f"a list, each item {describe_allowed(get_args(annotation)[0])}"
    if origin is dict:
        key, value = get_args(annotation)
        return f"an object mapping {describe_allowed(key)} to {describe_allowed(value)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"an object with keys {model_keys_text(annotation)}"
    raise TypeError(f"describe_allowed does not know how to word {annotation!r}; add a case or a Described(...)")


_BOUND_SYMBOLS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _bounds_text(metadata: tuple) -> str:
    bounds = {name: getattr(item, name) for item in metadata for name in _BOUND_SYMBOLS
              if getattr(item, name, None) is not None}
    if "ge" in bounds and "le" in bounds:
        return f" from {_number(bounds['ge'])} to {_number(bounds['le'])}"
    return " and".join(f" {_BOUND_SYMBOLS[name]} {_number(bound)}" for name, bound in bounds.items())


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _flatten(metadata: tuple) -> tuple:
    """Metadata with any FieldInfo (from `Annotated[int, Field(ge=1)]`) replaced by its own metadata."""
    flat = []
    for item in metadata:
        flat.extend(item.metadata if isinstance(item, FieldInfo) else [item])
    return tuple(flat)


def _is_optional(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)
