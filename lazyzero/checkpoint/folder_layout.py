"""Names inside a checkpoint folder (`save_dir`), shared by the engine, the CLI and the tests, and
the one rule every reader of the folder goes through.

    save_dir/latest                      the committed tag to resume from (written by rename)
    save_dir/<tag>/                      a committed checkpoint: DeepSpeed's files + MANIFEST_NAME
    save_dir/.lazyzero-tmp.<tag>/        a checkpoint being written; never listed, cleaned at start
    save_dir/.lazyzero-trash.<tag>/      a checkpoint being deleted (retention, re-saved tag)

The folder is the boundary (docs/reliability.md, "Folders written by someone else"): below
`save_dir`, no part of a path lazyzero reads may be a symbolic link (tag folders, `latest`,
manifests, state files), and names never hold '..' or separators where one folder is meant, so a
path that is read stays inside. `open_inside` is where this holds: it walks the path one part at a
time through the parent's descriptor with O_NOFOLLOW, so a link swapped in after a check is refused
too, and it opens regular files only (a FIFO would block the reader forever).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

MANIFEST_NAME = "lazyzero_manifest.json"
LATEST_NAME = "latest"
TEMP_PREFIX = ".lazyzero-tmp."
TRASH_PREFIX = ".lazyzero-trash."


def temp_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f"{TEMP_PREFIX}{tag}"


def trash_dir(save_dir: str | os.PathLike, tag: str) -> Path:
    return Path(save_dir) / f"{TRASH_PREFIX}{tag}"


def leftover_dirs(save_dir: str | os.PathLike) -> list[Path]:
    """Temporary and half-deleted folders a crashed or killed run left behind (a symbolic link with
    such a name too: it is removed, never followed)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.name.startswith((TEMP_PREFIX, TRASH_PREFIX)) and (p.is_symlink() or p.is_dir()))


class UnsafeCheckpointPath(ValueError):
    """A tag, a 'latest' file or a manifest entry that would lead outside its checkpoint folder."""


class SymbolicLinkRefused(UnsafeCheckpointPath):
    """A symbolic link where a checkpoint folder holds a plain file or folder."""


# 'latest' holds one tag; anything longer is not a pointer written by lazyzero or DeepSpeed.
LATEST_MAX_BYTES = 4096


def read_latest(save_dir: str | os.PathLike) -> str | None:
    """The tag 'latest' names, or None without one. A 'latest' that is a symbolic link, or names
    anything but a folder directly under save_dir ('../x', an absolute path), is refused
    (docs/reliability.md, guarantee 2)."""
    path = Path(save_dir) / LATEST_NAME
    if not os.path.lexists(path):
        return None
    tag = read_inside(save_dir, LATEST_NAME, LATEST_MAX_BYTES).decode(errors="replace").strip()
    try:
        return check_tag(tag)
    except ValueError as err:
        raise UnsafeCheckpointPath(f"{path}: {err}") from None


def latest_text(save_dir: str | os.PathLike) -> str | None:
    """What the 'latest' file says, unchecked: only to put it back as it was (None without a plain one)."""
    try:
        return read_inside(save_dir, LATEST_NAME, LATEST_MAX_BYTES).decode(errors="replace").strip()
    except (OSError, UnsafeCheckpointPath):
        return None


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


def link_problem(path: Path) -> str | None:
    """Why `path` may not be read, if it is a symbolic link (its target is named, never followed)."""
    if not path.is_symlink():
        return None
    return f"{path}: a symbolic link (to {os.readlink(path)}); a checkpoint folder holds plain folders and files only"


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
# Where the platform lacks O_NOFOLLOW or openat, each part is checked by lstat before the open.
_WALK_BY_DESCRIPTOR = bool(_NOFOLLOW and _DIRECTORY) and os.open in os.supports_dir_fd


def open_inside(root: str | os.PathLike, relpath: str) -> int:
    """A read-only descriptor of the regular file root/relpath, opened without following a symbolic
    link at any part below `root`. UnsafeCheckpointPath names a link or a file of another kind; a
    missing file is FileNotFoundError naming the whole path."""
    root = Path(root)
    parts = check_relative_path(relpath).split("/")
    if not _WALK_BY_DESCRIPTOR:
        return _open_after_lstat(root, parts)
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, part in enumerate(parts):
            is_folder = depth < len(parts) - 1
            flags = os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW | _NONBLOCK | (_DIRECTORY if is_folder else 0)
            try:
                next_fd = os.open(part, flags, dir_fd=fd)
            except OSError as err:
                raise _open_error(root, parts[:depth + 1], fd, err) from None
            os.close(fd)
            fd = next_fd
        _check_regular(fd, root / relpath)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_error(root: Path, parts: list[str], parent_fd: int, err: OSError) -> Exception:
    """The error for a part that would not open: a symbolic link is refused naming its target;
    anything else keeps its errno, with the whole path."""
    path = root.joinpath(*parts)
    try:
        target = os.readlink(parts[-1], dir_fd=parent_fd)
    except OSError:
        return type(err)(err.errno, err.strerror, str(path))
    return SymbolicLinkRefused(f"{path}: a symbolic link (to {target}); a checkpoint folder holds plain folders "
                               "and files only")


def _open_after_lstat(root: Path, parts: list[str]) -> int:
    current = root
    for part in parts:
        current = current / part
        problem = link_problem(current)
        if problem:
            raise SymbolicLinkRefused(problem)
    fd = os.open(current, os.O_RDONLY | _NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        _check_regular(fd, current)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(fd: int, path: Path) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise UnsafeCheckpointPath(f"{path}: not a regular file ({_kind(mode)}); a checkpoint folder holds plain "
                                   "folders and files only")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    return "not a plain file"


def file_inside(root: str | os.PathLike, relpath: str) -> BinaryIO:
    """root/relpath opened for reading by `open_inside`, as a file object."""
    return os.fdopen(open_inside(root, relpath), "rb")


def read_inside(root: str | os.PathLike, relpath: str, limit: int) -> bytes:
    """The bytes of root/relpath (by `open_inside`); UnsafeCheckpointPath if it holds more than `limit`."""
    with file_inside(root, relpath) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeCheckpointPath(f"{Path(root) / relpath}: {max(size, len(data)):,} bytes; expected at most "
                                   f"{limit:,}")
    return data


def in_tag(tag_dir: str | os.PathLike, relpath: str = "") -> tuple[Path, str]:
    """(save_dir, path under it) of a file of `tag_dir`, so that the tag folder itself is opened
    without following a link as well."""
    tag_dir = Path(tag_dir)
    return tag_dir.parent, f"{tag_dir.name}/{relpath}" if relpath else tag_dir.name
