"""Generated config fuzz (docs/reliability.md, what is tested): for every field of every sub-model, a wrong-type value
and out-of-range values derived from the field's own bounds, plus a misspelled key per sub-model.
Each must be rejected with its key path and the words "allowed". A property test then throws random
JSON at random keys and checks that every rejection keeps the documented one-line format.
"""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from lazyzero.config import LazyZeroConfig, LazyZeroConfigError, parse_memory_size, validate_ds_config

SECTIONS = {name: field.annotation for name, field in LazyZeroConfig.model_fields.items()}


def base_and_metadata(field: FieldInfo) -> tuple[Any, list]:
    """The field's type with Optional and Annotated peeled off, and all metadata found on the way."""
    annotation, metadata = field.annotation, list(field.metadata)
    while True:
        if get_origin(annotation) in (Union, types.UnionType):
            (annotation,) = [arg for arg in get_args(annotation) if arg is not type(None)]
        elif get_origin(annotation) is Annotated:
            annotation, *extra = get_args(annotation)
            metadata += extra
        else:
            return annotation, metadata


def accepts_strings(base: Any, metadata: list) -> bool:
    is_memory_size = any(getattr(item, "func", None) is parse_memory_size for item in metadata)
    is_text_choice = get_origin(base) is Literal and isinstance(get_args(base)[0], str)
    return base is str or is_text_choice or is_memory_size


def wrong_type_values(base: Any, metadata: list) -> list:
    """Values of a JSON type the field never accepts. "7" catches lax coercion of numeric strings."""
    container = get_origin(base)
    values = ["wrong-type"] if container is dict else [{"wrong": "type"}]
    if not accepts_strings(base, metadata) and container not in (dict, list):
        values.append("7")
    return values


def bound(metadata: list, name: str):
    for item in metadata:
        for candidate in getattr(item, "metadata", [item]):
            if getattr(candidate, name, None) is not None:
                return getattr(candidate, name)
    return None


def out_of_range_values(base: Any, metadata: list) -> list:
    """Values of the right type outside what the field allows (for lists and dicts: one bad item); may be empty."""
    if get_origin(base) is Literal:
        choices = get_args(base)
        return ["bogus"] if isinstance(choices[0], str) else [max(choices) + 1]
    if any(getattr(item, "func", None) is parse_memory_size for item in metadata):
        return [0, "-5GB", "12 parsecs"]
    if base is str:
        return [""]
    if get_origin(base) is list:
        return [[item] for item in _bad_items(get_args(base)[0])]
    if get_origin(base) is dict:
        return [{"pattern": item} for item in _bad_items(get_args(base)[1])]
    values = []
    step = 1 if base is int else 0.5
    if bound(metadata, "ge") is not None:
        values.append(bound(metadata, "ge") - step)
    if bound(metadata, "gt") is not None:
        values.append(bound(metadata, "gt"))
    if bound(metadata, "le") is not None:
        values.append(bound(metadata, "le") + step)
    if any("power of two" in getattr(item, "allowed", "") for item in metadata):
        values.append(bound(metadata, "ge") + 1)
    return values


def _bad_items(item_annotation: Any) -> list:
    base, metadata = base_and_metadata(FieldInfo.from_annotation(item_annotation))
    return wrong_type_values(base, metadata)[:1] + out_of_range_values(base, metadata)


def generated_cases():
    for section, model in SECTIONS.items():
        for name, field in model.model_fields.items():
            base, metadata = base_and_metadata(field)
            for value in wrong_type_values(base, metadata):
                yield pytest.param(section, name, value, id=f"{section}.{name}-wrong-type-{value!r}")
            for value in out_of_range_values(base, metadata):
                yield pytest.param(section, name, value, id=f"{section}.{name}-out-of-range-{value!r}")


CASES = list(generated_cases())


def test_fuzz_covers_every_field():
    covered = {(case.values[0], case.values[1]) for case in CASES}
    assert covered == {(section, name) for section, model in SECTIONS.items() for name in model.model_fields}


@pytest.mark.parametrize("section, name, value", CASES)
def test_bad_value_is_rejected_with_its_key_path(section, name, value):
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"lazyzero": {section: {name: value}}})
    path = f"lazyzero.{section}.{name}"
    assert any(line.startswith(path) and "allowed" in line for line in caught.value.problems), str(caught.value)


def misspell(name: str) -> str:
    """`name` with its second and third letters swapped, or doubled when they are equal."""
    swapped = name[0] + name[2] + name[1] + name[3:]
    return swapped if swapped != name else name[:2] + name[1:]


@pytest.mark.parametrize("section, name", [(section, name) for section, model in SECTIONS.items()
                                           for name in model.model_fields])
def test_misspelled_key_is_rejected_with_a_suggestion(section, name):
    typo = misspell(name)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"lazyzero": {section: {typo: 1}}})
    assert caught.value.problems[0].startswith(f"lazyzero.{section}.{typo}: unknown key; allowed keys: ")
    assert caught.value.problems[0].endswith(f"did you mean {name!r}?")


@pytest.mark.parametrize("section", list(SECTIONS))
def test_misspelled_section_is_rejected_with_a_suggestion(section):
    typo = misspell(section)
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config({"lazyzero": {typo: {}}})
    assert caught.value.problems == [
        f"lazyzero.{typo}: unknown key; allowed keys: activations, checkpoint, distributed, gradients, optimizer, "
        f"plan; did you mean {section!r}?"]


# A rejection is "<key path>: got <value>; allowed..." or "<key path>: unknown key; allowed keys: ...";
# the key path is lazyzero's, or DeepSpeed's where a lazyzero setting conflicts with it (ZeRO's stage).
# An index is a number or a key as Python's repr() writes it, which may hold "]" (['], found by hypothesis).
PROBLEM_LINE = re.compile(r"^(lazyzero|zero_optimization)(\.\w+)*"
                          r"(\[(\d+|'([^'\\]|\\.)*'|\"([^\"\\]|\\.)*\"|[^\]'\"]+)\])*: "
                          r"(got .+; (allowed|not available).+|unknown key; allowed keys: .+)$")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6)
KEYS = st.sampled_from([f"{section}.{name}" for section, model in SECTIONS.items() for name in model.model_fields])


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.dictionaries(KEYS, JSON_VALUES, min_size=1, max_size=4))
def test_random_values_are_accepted_or_rejected_in_the_documented_format(assignments):
    section_config: dict = {}
    for key, value in assignments.items():
        section, name = key.split(".")
        section_config.setdefault(section, {})[name] = value
    try:
        validate_ds_config({"lazyzero": section_config})
    except LazyZeroConfigError as error:
        assert error.problems, str(error)
        for line in error.problems:
            assert PROBLEM_LINE.match(line), line
