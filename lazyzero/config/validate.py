"""Loading and validating a DeepSpeed config with its "lazyzero" section: the entry points.

Every problem found is collected and raised together in one `LazyZeroConfigError`, so a user fixes
a config in one round. Nothing here writes to disk or creates a folder (docs/reliability.md, guarantee 6).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

from pydantic import ValidationError

from lazyzero.config.cross_checks import deepspeed_settings_problems, lazyzero_against_deepspeed_problems
from lazyzero.config.deepspeed_parse import deepspeed_parse_problems
from lazyzero.config.errors import LazyZeroConfigError, Problem
from lazyzero.config.initialize_checks import initialize_problems
from lazyzero.config.models import LazyZeroConfig
from lazyzero.config.pydantic_errors import problems_from_validation_error

SECTION = "lazyzero"


class _DuplicateKey(ValueError):
    pass


class _NonStandardConstant(ValueError):
    pass


def load_ds_config_file(path: Union[str, os.PathLike]) -> dict:
    """The JSON object in `path`. Strict JSON: no duplicate keys, no NaN or Infinity.

    Raises LazyZeroConfigError naming the file when it is missing, a directory, unreadable, not
    UTF-8, not valid JSON (with line:column), or its top level is not an object.
    """
    name = os.fspath(path)
    try:
        text = Path(name).read_bytes().decode("utf-8-sig")
    except FileNotFoundError:
        raise LazyZeroConfigError([Problem(name, "no such file; allowed: a JSON file")]) from None
    except IsADirectoryError:
        raise LazyZeroConfigError([Problem(name, "got a directory; allowed: a JSON file")]) from None
    except UnicodeDecodeError as error:
        raise LazyZeroConfigError(
            [Problem(name, f"not UTF-8 text (byte {error.start}); allowed: a JSON file")]) from None
    except OSError as error:
        raise LazyZeroConfigError(
            [Problem(name, f"cannot be read ({error.strerror}); allowed: a readable JSON file")]) from None
    try:
        loaded = json.loads(text, object_pairs_hook=_object_without_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise LazyZeroConfigError(
            [Problem(f"{name}:{error.lineno}:{error.colno}", f"invalid JSON: {error.msg}")]) from None
    except (_DuplicateKey, _NonStandardConstant) as error:
        raise LazyZeroConfigError([Problem(name, f"invalid JSON: {error}")]) from None
    if not isinstance(loaded, dict):
        raise LazyZeroConfigError(
            [Problem(name, f"got a JSON {type(loaded).__name__} at the top level; allowed: a JSON object")])
    return loaded


def validate_ds_config(ds_config: Union[dict, str, os.PathLike], *, world_size: Optional[int] = None,
                       run_deepspeed_checks: bool = False) -> LazyZeroConfig:
    """The validated "lazyzero" section of `ds_config` (a dict, or a path to a JSON file).

    An absent section means every default, i.e. every feature off. Checks, all reported together:
    the section's schema; the section against
    the DeepSpeed settings around it; the ZeRO and offload settings lazyzero relies on (NVMe paths
    must exist and be writable); settings with which deepspeed.initialize would build what
    lazyzero.initialize does not (initialize_checks.py); with `world_size`, that the two-hop layout
    fits it; with `run_deepspeed_checks`, DeepSpeed's own parse (imports DeepSpeed, seconds).
    Raises LazyZeroConfigError listing every problem. Creates and modifies nothing.
    """
    if world_size is not None and (type(world_size) is not int or world_size < 1):
        raise ValueError(f"world_size must be an integer >= 1 or None, got {world_size!r}")
    source = None
    if isinstance(ds_config, (str, os.PathLike)):
        source = os.fspath(ds_config)
        ds_config = load_ds_config_file(ds_config)
    elif not isinstance(ds_config, dict):
        raise LazyZeroConfigError([Problem("DeepSpeed config", f"got a {type(ds_config).__name__}; "
                                                               "allowed: a dict, or the path of a JSON file")])
    config, problems = _validate_section(ds_config.get(SECTION, {}))
    if config is not None:
        problems += lazyzero_against_deepspeed_problems(config, ds_config, world_size)
    problems += deepspeed_settings_problems(ds_config)
    problems += initialize_problems(config, ds_config)
    if run_deepspeed_checks:
        problems += deepspeed_parse_problems(ds_config, world_size, source)
    if problems:
        raise LazyZeroConfigError(problems, source)
    return config


def check_config_file(path: Union[str, os.PathLike], *, world_size: Optional[int] = None,
                      run_deepspeed_checks: bool = True) -> LazyZeroConfig:
    """`lazyzero config check FILE.json`: every check of `validate_ds_config`, DeepSpeed's own parse included."""
    return validate_ds_config(path, world_size=world_size, run_deepspeed_checks=run_deepspeed_checks)


def _validate_section(section: object) -> tuple[Optional[LazyZeroConfig], list[Problem]]:
    try:
        return LazyZeroConfig.model_validate(section), []
    except ValidationError as error:
        return None, problems_from_validation_error(error, LazyZeroConfig, SECTION)


def _object_without_duplicates(pairs: list[tuple[str, object]]) -> dict:
    # Python's json keeps the last of two equal keys without a word; a silently lost setting is
    # exactly what this validation exists to prevent (DeepSpeed's own loader rejects them too).
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"key {key!r} appears twice in one object; allowed: each key once")
        result[key] = value
    return result


def _reject_constant(name: str) -> float:
    raise _NonStandardConstant(f"got {name}; allowed: JSON numbers (JSON has no NaN or Infinity)")
