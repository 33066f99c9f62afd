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


class UnsafeCheckpointPath(ValueError):
    """A tag, a 'latest' file or a manifest entry that would lead outside its checkpoint folder."""


def read_latest(save_dir: str | os.PathLike) -> str | None:
    """The tag 'latest' names, or None without one. A 'latest' naming anything but a folder directly
    under save_dir ('../x', an absolute path) is refused (docs/reliability.md, guarantee 2)."""
    tag = latest_text(save_dir)
    if tag is None:
        return None
    try:
        return check_tag(tag)
    except ValueError as err:
        raise UnsafeCheckpointPath(f"{Path(save_dir) / LATEST_NAME}: {err}") from None


def latest_text(save_dir: str | os.PathLike) -> str | None:
    """What the 'latest' file says, unchecked: only to put it back as it was."""
    path = Path(save_dir) / LATEST_NAME
    return path.read_text().strip() if path.is_file() else None


def check_tag(tag: str) -> str:
    """A tag names one folder directly under save_dir: no separators, not hidden, not '.' or '..'."""
    if not tag or "/" in tag or os.sep in tag or "\\" in tag or tag.startswith(".") or tag == LATEST_NAME:
        raise UnsafeCheckpointPath(f"checkpoint tag {tag!r}: must be a plain folder name, not starting with '.', "
                                   f"not {LATEST_NAME!r}")
    return tag


def check_relative_path(relpath: str) -> str:
    """A file listed in a manifest: a relative path inside its tag folder, in '/' form, with no '..',
    '.' or empty part (so that nothing outside the folder is read, hashed, linked or copied)."""
    parts = relpath.split("/") if isinstance(relpath, str) else [""]
    if relpath.startswith("/") or "\\" in relpath or any(part in ("", ".", "..") for part in parts):
        raise UnsafeCheckpointPath(f"file {relpath!r}: must be a relative path inside the checkpoint folder "
                                   f"('/'-separated, without '..', '.' or empty parts)")
    return relpath


def stays_inside(root: Path, path: Path) -> bool:
    """Whether `path` is a plain file or folder under `root` with no symbolic link on the way."""
    current = path
    while current != root:
        if current.is_symlink():
            return False
        if current.parent == current:
            return False
        current = current.parent
    return True
