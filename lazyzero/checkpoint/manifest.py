"""The manifest of a committed checkpoint, and verification against it (docs/reliability.md, guarantee 2).

`lazyzero_manifest.json` lists every file of the tag folder with its size and hash. Its body is
hashed too, so a flipped bit in the manifest itself is caught rather than trusted, and then checked
against its schema (manifest_schema.py), since anyone who can write the folder can recompute that
hash. A checkpoint folder without a manifest was never committed by lazyzero (or is plain
DeepSpeed's). Every read goes through `folder_layout.open_inside`: nothing outside the folder.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

from lazyzero.checkpoint.durable_io import HASH_NAME, hash_stream, new_hash, write_file_atomically
from lazyzero.checkpoint.folder_layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    SymbolicLinkRefused,
    UnsafeCheckpointPath,
    check_relative_path,
    file_inside,
    in_tag,
    leftover_dirs,
    link_problem,
    read_inside,
    read_latest,
)
from lazyzero.checkpoint.manifest_schema import MANIFEST_FORMAT, ManifestBody, schema_problems

# About 150 bytes a file: room for hundreds of thousands of files, and no reading of a file sized to
# exhaust memory.
MANIFEST_MAX_BYTES = 64 << 20
# What `on_damaged_latest` may say (lazyzero/checkpoint/config.py, CheckpointConfig).
STOP, FALL_BACK = "stop", "fall_back"


class CheckpointDamagedError(RuntimeError):
    """A checkpoint differs from its manifest; the message names each file, what was expected and found."""


@dataclass
class Manifest:
    tag: str
    world_size: int
    global_steps: int
    files: dict[str, dict] = field(default_factory=dict)  # relative path -> {"size", "hash", "rank"}
    created_unix: float = field(default_factory=time.time)
    format: int = MANIFEST_FORMAT
    hash: str = HASH_NAME

    @property
    def total_bytes(self) -> int:
        return sum(entry["size"] for entry in self.files.values())

    def to_json(self) -> bytes:
        body = {k: getattr(self, k) for k in ("format", "hash", "tag", "world_size", "global_steps", "created_unix")}
        body["files"] = dict(sorted(self.files.items()))
        return json.dumps({"body": body, "body_hash": _body_hash(body)}, indent=1).encode()

    def write(self, tag_dir: str | os.PathLike) -> None:
        write_file_atomically(Path(tag_dir) / MANIFEST_NAME, self.to_json())


def _body_hash(body: dict) -> str:
    digest = new_hash()
    digest.update(json.dumps(body, sort_keys=True).encode())
    return digest.hexdigest()


def read_manifest(tag_dir: str | os.PathLike) -> Manifest:
    """The manifest of `tag_dir`; CheckpointDamagedError naming it if it is missing, damaged or does
    not match its schema or its folder, UnsafeCheckpointPath if it or the tag folder is a symbolic
    link or it lists a path outside the folder."""
    path = Path(tag_dir) / MANIFEST_NAME
    try:
        data = read_inside(*in_tag(tag_dir, MANIFEST_NAME), MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointDamagedError(f"{path}: missing; expected the manifest of a committed lazyzero "
                                     "checkpoint") from None
    body = _checked_body(path, data)
    try:
        checked = ManifestBody.model_validate(body)
    except ValidationError as err:
        raise CheckpointDamagedError(f"{path}: refused: {schema_problems(err)} (manifest format "
                                     f"{MANIFEST_FORMAT})") from None
    for relpath in checked.files:
        try:
            check_relative_path(relpath)
        except UnsafeCheckpointPath as err:
            raise UnsafeCheckpointPath(f"{path}: refused: {err}") from None
    if checked.tag != Path(tag_dir).name:
        raise CheckpointDamagedError(f"{path}: refused: it was committed as tag {checked.tag!r} but is in the "
                                     f"folder {Path(tag_dir).name!r}; a copied or renamed tag is not the checkpoint "
                                     "its name says (rename it back to load it)")
    files = {relpath: entry.model_dump() for relpath, entry in checked.files.items()}
    return Manifest(checked.tag, checked.world_size, checked.global_steps, files, checked.created_unix)


def _checked_body(path: Path, data: bytes) -> dict:
    """The body of a manifest whose hash and format match; CheckpointDamagedError otherwise."""
    try:
        document = json.loads(data)
        body = document["body"]
        found = _body_hash(body)
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointDamagedError(f"{path}: damaged; expected a lazyzero manifest (JSON with body and body_hash), "
                                     f"found unreadable content ({err})") from None
    if found != document.get("body_hash"):
        raise CheckpointDamagedError(f"{path}: damaged; expected body hash {document.get('body_hash')}, found {found}")
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT or body.get("hash") != HASH_NAME:
        found_format = body.get("format") if isinstance(body, dict) else None
        found_hash = body.get("hash") if isinstance(body, dict) else None
        raise CheckpointDamagedError(f"{path}: format {found_format} with hash {found_hash}; "
                                     f"this lazyzero reads format {MANIFEST_FORMAT} with {HASH_NAME}")
    return body


def find_problems(tag_dir: str | os.PathLike, manifest: Manifest, check_hashes: bool = True,
                  on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """One line per file that is missing, of the wrong size or hash, a symbolic link or of another
    kind, or not in the manifest; `on_bytes(n)` reports hashing progress."""
    root = Path(tag_dir)
    problems = []
    for relpath, entry in sorted(manifest.files.items()):
        problem = _file_problem(root, relpath, entry, check_hashes, on_bytes)
        if problem:
            problems.append(problem)
    # rglob does not descend into linked folders; every other entry but a folder is a file to account for.
    for path in sorted(p for p in root.rglob("*") if p.is_symlink() or not p.is_dir()):
        relpath = path.relative_to(root).as_posix()
        if path.is_symlink():
            if relpath not in manifest.files:
                problems.append(link_problem(path))
            continue
        if relpath != MANIFEST_NAME and relpath not in manifest.files:
            problems.append(f"{path}: not in the manifest (foreign file); "
                            f"expected only the {len(manifest.files)} files it lists")
    return problems


def _file_problem(root: Path, relpath: str, entry: dict, check_hashes: bool,
                  on_bytes: Callable[[int], None] | None) -> str | None:
    """What is wrong with one listed file, read through `open_inside` (no link followed), or None."""
    path = root / check_relative_path(relpath)
    try:
        with file_inside(*in_tag(root, relpath)) as f:
            size = os.fstat(f.fileno()).st_size
            if size != entry["size"]:
                return f"{path}: expected {entry['size']} bytes, found {size}"
            if not check_hashes:
                return None
            _, digest = hash_stream(f, on_bytes=on_bytes)
    except SymbolicLinkRefused:
        return f"{path}: a symbolic link on the way; expected a plain file inside {root}"
    except UnsafeCheckpointPath as err:
        return f"{err}; expected a plain file inside {root}"
    except (FileNotFoundError, NotADirectoryError):
        return f"{path}: missing; expected {entry['size']} bytes"
    if digest != entry["hash"]:
        return f"{path}: expected {HASH_NAME} {entry['hash']}, found {digest} (contents changed)"
    return None


def verify_checkpoint(tag_dir: str | os.PathLike) -> Manifest:
    """The manifest, once every file matches it; CheckpointDamagedError listing every mismatch otherwise."""
    manifest = read_manifest(tag_dir)
    problems = find_problems(tag_dir, manifest)
    if problems:
        raise CheckpointDamagedError(f"checkpoint {tag_dir} is damaged ({len(problems)} problem(s)):\n  "
                                     + "\n  ".join(problems))
    return manifest


@dataclass
class CheckpointEntry:
    tag: str
    path: Path
    manifest: Manifest | None  # None: the folder has no readable manifest
    problem: str = ""
    damaged: bool = False  # no manifest because it is damaged or refused (not merely absent), or a link


def list_checkpoints(save_dir: str | os.PathLike) -> list[CheckpointEntry]:
    """Every tag folder of `save_dir`, oldest commit first; folders without a readable manifest last.
    A symbolic link where a tag folder would be is listed as damaged, never followed."""
    root = Path(save_dir)
    skip = {p.name for p in leftover_dirs(root)}
    entries = []
    for path in sorted(root.iterdir()):
        if path.name in skip or path.name.startswith(".") or path.name == LATEST_NAME:
            continue
        if path.is_symlink():
            entries.append(CheckpointEntry(path.name, path, None, link_problem(path), damaged=True))
        elif path.is_dir():
            entries.append(_entry(path))
    return sorted(entries, key=lambda e: (e.manifest is None, e.manifest.created_unix if e.manifest else 0, e.tag))


def _entry(path: Path) -> CheckpointEntry:
    try:
        return CheckpointEntry(path.name, path, read_manifest(path))
    except (CheckpointDamagedError, UnsafeCheckpointPath) as err:
        return CheckpointEntry(path.name, path, None, str(err), damaged=os.path.lexists(path / MANIFEST_NAME))


def committed_tags(save_dir: str | os.PathLike) -> list[str]:
    """Tags with a readable manifest, oldest first."""
    return [e.tag for e in list_checkpoints(save_dir) if e.manifest is not None]


def resolve_tag_to_load(save_dir: str | os.PathLike, on_damaged_latest: str = STOP) -> tuple[str | None, str]:
    """The tag to resume from: 'latest' if it names a committed checkpoint, else the newest committed
    one (with a reason to warn about), else None. If 'latest' names a tag whose manifest is damaged or
    refused, CheckpointDamagedError (STOP) or the newest committed one with a warning (FALL_BACK)."""
    latest = read_latest(save_dir)
    entries = list_checkpoints(save_dir) if Path(save_dir).is_dir() else []
    committed = [e.tag for e in entries if e.manifest is not None]
    named = next((e for e in entries if e.tag == latest), None)
    if named is not None and named.damaged:
        tag = damaged_latest(save_dir, latest, named.problem, committed, on_damaged_latest)
        return tag, fell_back_warning(save_dir, latest, named.problem, tag)
    if latest is not None and (latest in committed or ((Path(save_dir) / latest).is_dir() and not committed)):
        return latest, ""
    if not committed:
        why = f"'latest' names {latest!r}, which is not a committed checkpoint" if latest else "no 'latest' file"
        return None, f"{save_dir}: {why}, and no committed lazyzero checkpoint was found"
    why = (f"'latest' names {latest!r}, which is missing or was never committed" if latest is not None
           else "no 'latest' file")
    return committed[-1], f"{save_dir}: {why}; loading the newest committed checkpoint {committed[-1]!r} instead"


def damaged_latest(save_dir: str | os.PathLike, tag: str, problem: str, others: list[str],
                   on_damaged_latest: str) -> str:
    """The tag to try instead of `tag`, the damaged checkpoint a resume would load: the newest of the
    other committed ones, `others` (oldest first), under FALL_BACK; CheckpointDamagedError saying
    what is damaged and how to load an older one otherwise (docs/reliability.md, guarantee 2)."""
    if on_damaged_latest == FALL_BACK and others:
        return others[-1]
    if others:
        instead = (f"Not loading an older checkpoint in its place: to resume from the newest other committed one, "
                   f"{others[-1]!r}, set lazyzero.checkpoint.on_damaged_latest: {FALL_BACK}, or load that tag by name")
    else:
        instead = "No other committed checkpoint is there to load instead"
    raise CheckpointDamagedError(f"{save_dir}: the newest checkpoint, {tag!r}, is damaged: {problem}\n{instead}")


def fell_back_warning(save_dir: str | os.PathLike, tag: str, problem: str, loaded: str) -> str:
    return (f"{save_dir}: the newest checkpoint, {tag!r}, is DAMAGED: {problem}\n"
            f"loading the older checkpoint {loaded!r} instead (lazyzero.checkpoint.on_damaged_latest: {FALL_BACK})")
