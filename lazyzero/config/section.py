"""The base of every model in the "lazyzero" section (each capability's own in `lazyzero/<capability>/config.py`).

Why not DeepSpeed's `DeepSpeedConfigModel` (deepspeed/runtime/config_utils.py) as the base class:
- its `__init__(strict=False, **data)` silently drops every value equal to "auto", so
  `"gpu_mem": "auto"` would fall back to the default instead of being rejected, and it takes a
  key named "strict" as its own argument, so `{"strict": 1}` in any sub-section is swallowed
  instead of reported as unknown (both checked against DeepSpeed 0.19.8, also for nested models);
- importing it imports torch and DeepSpeed (about 3 s), which `lazyzero config check` must not pay;
- its one addition, renamed/deprecated fields, keeps accepting an old spelling, where lazyzero refuses
  it naming the new key (`ConfigSection.retired_keys`), so that one spelling stays in use.
So the models use pydantic's BaseModel with the same `extra="forbid"`, plus strict types: JSON has
real booleans and numbers, and "yes" or "4" are more likely mistakes than intentions.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    """Base of every model in the "lazyzero" section.

    Every capability is switched by its own `enabled: bool = False`. Spellings the switches had
    before are refused, through the usual problem lines, with a hint naming the key to use instead.
    """

    retired_keys: ClassVar[dict[str, str]] = {}
    """Removed key -> what to write instead (the problem reads "<path>: removed; <hint>")."""

    retired_values: ClassVar[dict[str, dict[Any, str]]] = {}
    """Field -> {value it no longer takes -> hint added to the problem after what is allowed}."""

    planned_fields: ClassVar[tuple[str, ...]] = ()
    """Fields the memory planner sets when `lazyzero.plan.enabled` is true (lazyzero/plan/config.py):
    a value given for one is refused, and a new plan replaces them while the section's other fields stay."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        validate_assignment=True,
    )
