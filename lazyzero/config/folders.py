"""Checks of a folder a config names: it exists and this process can write to it, without creating
anything (docs/reliability.md, guarantee 6); for NVMe, also that DeepSpeed's async_io loads here."""

from __future__ import annotations

import os
from typing import Any

from lazyzero.config.async_io import async_io_problems
from lazyzero.config.errors import Problem

WRITABLE_DIRECTORY = "an existing directory this process can write to"


def nvme_folder_problems(path: str, directory: Any) -> list[Problem]:
    """A folder the run swaps to: writable (`directory_problems`), on a machine where DeepSpeed's
    async_io loads (`lazyzero/config/async_io.py`)."""
    return directory_problems(path, directory) or async_io_problems(path)


def directory_problems(path: str, directory: Any) -> list[Problem]:
    """Empty if `directory` exists, is a directory and is writable; checked without creating anything."""
    if not isinstance(directory, str) or not directory:
        return [Problem.bad_value(path, directory, WRITABLE_DIRECTORY)]
    if not os.path.exists(directory):
        reason = "it does not exist; lazyzero does not create it"
    elif not os.path.isdir(directory):
        reason = "it is not a directory"
    elif not os.access(directory, os.W_OK | os.X_OK):
        reason = "this process may not write to it"
    else:
        return []
    return [Problem.bad_value(path, directory, f"{WRITABLE_DIRECTORY} ({reason})")]
