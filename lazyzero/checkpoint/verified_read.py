"""Each checkpoint file is loaded from the bytes whose hash was checked (docs/reliability.md, guarantee 2).

Verifying a tag hashes every file before DeepSpeed loads any; a file rewritten between that check and
its load would otherwise be trusted. While a tag is being loaded, `VerifiedFiles` knows its folder and,
when it was verified, each file's expected hash: a file of that tag is opened without following a
symbolic link at any part (folder_layout.open_inside), read once, whole, into memory, hashed, and
deserialized from those same bytes (`load_checkpoint_file`, which runs no code). A tag without a
manifest (allowed only by `allow_unverified`, or DeepSpeed's own folders with lazy checkpoints off)
is read through the same open, unhashed. Files outside the tag load as they are.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from lazyzero.checkpoint.durable_io import HASH_NAME, new_hash
from lazyzero.checkpoint.folder_layout import file_inside, in_tag
from lazyzero.checkpoint.manifest import CheckpointDamagedError, Manifest
from lazyzero.safe_load import load_checkpoint_file


def _key(path: str | os.PathLike) -> str:
    """The path as DeepSpeed spells it, made absolute without resolving links (a link must not make a
    file of the tag look like a file elsewhere)."""
    return os.path.abspath(path)


class VerifiedFiles:
    """The folder of the tag being loaded and the expected hash of each of its files (none outside a load)."""

    def __init__(self) -> None:
        self._tag_dir: str | None = None
        self._expected: dict[str, str] = {}

    def expect(self, tag_dir: str | os.PathLike, manifest: Manifest | None) -> None:
        """Load the files of `tag_dir` only through `open_inside`, and from bytes matching `manifest`
        when there is one, until `clear()`."""
        self._tag_dir = _key(tag_dir)
        files = manifest.files if manifest is not None else {}
        self._expected = {_key(Path(tag_dir) / relpath): entry["hash"] for relpath, entry in files.items()}

    def clear(self) -> None:
        self._tag_dir = None
        self._expected = {}

    def load(self, path: str | os.PathLike, map_location=None, allow_pickle: bool = False):
        """The checkpoint file `path`, deserialized without running code; from bytes checked against
        the manifest when it belongs to the tag being loaded."""
        relpath = self._relpath_in_tag(path)
        if relpath is None:
            return load_checkpoint_file(path, map_location, allow_pickle)
        expected = self._expected.get(_key(path))
        with file_inside(*in_tag(self._tag_dir, relpath)) as f:
            if expected is None:
                return load_checkpoint_file(f, map_location, allow_pickle, label=path)
            data = f.read()
        digest = new_hash()
        digest.update(data)
        if digest.hexdigest() != expected:
            raise CheckpointDamagedError(f"{path}: expected {HASH_NAME} {expected}, found {digest.hexdigest()} "
                                         f"(changed after the checkpoint was verified)")
        return load_checkpoint_file(io.BytesIO(data), map_location, allow_pickle, label=path)

    def _relpath_in_tag(self, path: str | os.PathLike) -> str | None:
        if self._tag_dir is None:
            return None
        relpath = os.path.relpath(_key(path), self._tag_dir)
        if relpath == os.curdir or relpath == os.pardir or relpath.startswith(os.pardir + os.sep):
            return None
        return Path(relpath).as_posix()
