"""Names inside a checkpoint folder (`save_dir`), shared by the engine, the CLI and the tests.

    save_dir/latest                      the committed tag to resume from (written by rename)
    save_dir/<tag>/                      a committed checkpoint: DeepSpeed's files + MANIFEST_NAME
    save_dir/.lazyzero-tmp.<tag>/        a checkpoint being written; never listed, cleaned at start
    save_dir/.lazyzero-trash.<tag>/      a checkpoint being deleted (retention, re-saved tag)
"""

from __future__ import annotations

import os
from pathlib import Path

MANIFEST_NAME = "lazyzero_manifest.json"
LATEST_NAME = "latest"
TEMP_PREFIX = ".lazyzero-tmp."
TRASH_PREFIX = ".lazyzero-trash."


def temp_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f"{TEMP_PREFIX}{tag}"


def trash_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f"{TRASH_PREFIX}{tag}"


def leftover_dirs(save_dir: str | os.PathLike) -> list[Path]:
    """Temporary and half-deleted folders a crashed or killed run left behind."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith((TEMP_PREFIX, TRASH_PREFIX)))


def read_latest(save_dir: str | os.PathLike) -> str | None:
    path = Path(save_dir) / LATEST_NAME
    return path.read_text().strip() if path.is_file() else None


def check_tag(tag: str) -> str:
    """A tag names one folder directly under save_dir: no separators, not hidden, not '.' or '..'."""
    if not tag or "/" in tag or os.sep in tag or tag.startswith(".") or tag == LATEST_NAME:
        raise ValueError(f"checkpoint tag {tag!r}: must be a plain folder name, not starting with '.', "
                         f"not {LATEST_NAME!r}")
    return tag
