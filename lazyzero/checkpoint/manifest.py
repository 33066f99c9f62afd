"""The manifest of a committed checkpoint, and verification against it (docs/reliability.md, guarantee 2).

`lazyzero_manifest.json` lists every file of the tag folder with its size and hash. Its body is
hashed too, so a flipped bit in the manifest itself is caught rather than trusted, and then checked
against its schema (manifest_schema.py), since anyone who can write the folder can recompute that
hash. A checkpoint folder without a manifest was never committed by lazyzero (or is plain
DeepSpeed's).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

from lazyzero.checkpoint.durable_io import HASH_NAME, hash_file, new_hash, write_file_atomically
from lazyzero.checkpoint.folder_layout import (
    MANIFEST_NAME,
    UnsafeCheckpointPath,
    check_relative_path,
    leftover_dirs,
    read_latest,
    stays_inside,
)
from lazyzero.checkpoint.manifest_schema import MANIFEST_FORMAT, ManifestBody, schema_problems


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
    """The manifest of `tag_dir`; CheckpointDamagedError naming it if it is missing or damaged."""
    path = Path(tag_dir) / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointDamagedError(f"{path}: missing; expected the manifest of a committed lazyzero checkpoint")
    try:
        document = json.loads(path.read_bytes())
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


def find_problems(tag_dir: str | os.PathLike, manifest: Manifest, check_hashes: bool = True,
                  on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """One line per file that is missing, of the wrong size or hash, or not in the manifest;
    `on_bytes(n)` reports hashing progress."""
    root = Path(tag_dir)
    problems = []
    for relpath, entry in sorted(manifest.files.items()):
        path = root / check_relative_path(relpath)
        if not stays_inside(root, path):
            problems.append(f"{path}: a symbolic link on the way; expected a plain file inside {root}")
            continue
        if not path.is_file():
            problems.append(f"{path}: missing; expected {entry['size']} bytes")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{path}: expected {entry['size']} bytes, found {size}")
            continue
        if check_hashes:
            _, digest = hash_file(path, on_bytes=on_bytes)
            if digest != entry["hash"]:
                problems.append(f"{path}: expected {HASH_NAME} {entry['hash']}, found {digest} (contents changed)")
    for path in sorted(p for p in root.rglob("*") if p.is_symlink() or p.is_file()):
        relpath = path.relative_to(root).as_posix()
        if path.is_symlink():
            if relpath not in manifest.files:
                problems.append(f"{path}: a symbolic link (to {os.readlink(path)}); "
                                "a checkpoint holds plain files only")
            continue
        if relpath != MANIFEST_NAME and relpath not in manifest.files:
            problems.append(f"{path}: not in the manifest (foreign file); "
                            f"expected only the {len(manifest.files)} files it lists")
    return problems


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


def list_checkpoints(save_dir: str | os.PathLike) -> list[CheckpointEntry]:
    """Every tag folder of `save_dir`, oldest commit first; folders without a readable manifest last."""
    root = Path(save_dir)
    skip = {p.name for p in leftover_dirs(root)}
    entries = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in skip and not p.name.startswith(".")):
        try:
            entries.append(CheckpointEntry(path.name, path, read_manifest(path)))
        except (CheckpointDamagedError, UnsafeCheckpointPath) as err:
            entries.append(CheckpointEntry(path.name, path, None, str(err)))
    return sorted(entries, key=lambda e: (e.manifest is None, e.manifest.created_unix if e.manifest else 0, e.tag))


def committed_tags(save_dir: str | os.PathLike) -> list[str]:
    """Tags with a readable manifest, oldest first."""
    return [e.tag for e in list_checkpoints(save_dir) if e.manifest is not None]


def resolve_tag_to_load(save_dir: str | os.PathLike) -> tuple[str | None, str]:
    """The tag to resume from: 'latest' if it names a committed checkpoint, else the newest committed
    one (with a reason to warn about), else None."""
    latest = read_latest(save_dir)
    committed = committed_tags(save_dir) if Path(save_dir).is_dir() else []
    if latest is not None and (latest in committed or ((Path(save_dir) / latest).is_dir() and not committed)):
        return latest, ""
    if not committed:
        why = f"'latest' names {latest!r}, which is not a committed checkpoint" if latest else "no 'latest' file"
        return None, f"{save_dir}: {why}, and no committed lazyzero checkpoint was found"
    why = (f"'latest' names {latest!r}, which is missing or was never committed" if latest is not None
           else "no 'latest' file")
    return committed[-1], f"{save_dir}: {why}; loading the newest committed checkpoint {committed[-1]!r} instead"
