"""Memory sizes in the config: an int byte count, or a string such as "70GB", "400GiB", "512MB"."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

# Decimal units are powers of 1000 and binary units powers of 1024, as in IEC 80000-13, so that
# "70GB" means what a disk vendor means and "64GiB" what `free -g` means. Single letters ("70G")
# are refused because readers disagree on which of the two they mean.
UNIT_BYTES = {
    "B": 1,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
}

MEMORY_SIZE_ALLOWED = (
    "a byte count > 0, or a string like '70GB', '400GiB', '512MB' "
    "(units B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)"
)

_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_memory_size(value: Any) -> int:
    """Bytes in `value`: a positive int, an integral float (JSON's 7e10), or a number with a unit.

    Raises ValueError (with `MEMORY_SIZE_ALLOWED` in the message) for anything else, including
    booleans, zero, and sizes that are not a whole number of bytes ("0.5B").
    """
    if isinstance(value, bool):
        raise ValueError(f"a boolean is not a memory size; allowed: {MEMORY_SIZE_ALLOWED}")
    if isinstance(value, int):
        return _positive(value, value)
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number of bytes; allowed: {MEMORY_SIZE_ALLOWED}")
        return _positive(int(value), value)
    if isinstance(value, str):
        return _parse_size_string(value)
    raise ValueError(f"{type(value).__name__} is not a memory size; allowed: {MEMORY_SIZE_ALLOWED}")


def _parse_size_string(text: str) -> int:
    match = _SIZE_PATTERN.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in UNIT_BYTES):
        raise ValueError(f"{text!r} is not a memory size; allowed: {MEMORY_SIZE_ALLOWED}")
    # Decimal keeps "1.5GB" exact; a float would make it 1499999999.9999998 bytes.
    num_bytes = Decimal(match.group(1)) * UNIT_BYTES[unit or "B"]
    if num_bytes != num_bytes.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes; allowed: {MEMORY_SIZE_ALLOWED}")
    return _positive(int(num_bytes), text)


def _positive(num_bytes: int, given: Any) -> int:
    if num_bytes <= 0:
        raise ValueError(f"{given!r} is not a positive size; allowed: {MEMORY_SIZE_ALLOWED}")
    return num_bytes
