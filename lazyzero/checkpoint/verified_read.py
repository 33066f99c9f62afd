"""Each checkpoint file is loaded from the bytes whose hash was checked (docs/reliability.md, guarantee 2).

Verifying a tag hashes every file before DeepSpeed loads any; a file rewritten between that check and
its load would otherwise be trusted. While a verified tag is being loaded, `VerifiedFiles` knows each
file's expected hash: a file of that tag is read once, whole, into memory, hashed, and deserialized
from those same bytes (`load_checkpoint_file`, which runs no code). Files outside the tag load as they
are, and so does every file when the tag has no manifest (allowed only by `allow_unverified`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from lazyzero.checkpoint.durable_io import HASH_NAME, new_hash
from lazyzero.checkpoint.manifest import CheckpointDamagedError, Manifest
from lazyzero.safe_load import load_checkpoint_file


class VerifiedFiles:
    """The expected hash of every file of the tag being loaded (none outside a load)."""

    def __init__(self) -> None:
        self._expected: dict[Path, str] = {}

    def expect(self, tag_dir: str | os.PathLike, manifest: Manifest) -> None:
        """Load the files of `tag_dir` only from bytes matching `manifest` until `clear()`."""
        root = Path(tag_dir).resolve()
        self._expected = {root / relpath: entry["hash"] for relpath, entry in manifest.files.items()}

    def clear(self) -> None:
        self._expected = {}

    def load(self, path: str | os.PathLike, map_location=None, allow_pickle: bool = False):
        """The checkpoint file `path`, deserialized without running code; from bytes checked against
        the manifest when it belongs to the tag being loaded."""
        expected = self._expected.get(Path(path).resolve())
        if expected is None:
            return load_checkpoint_file(path, map_location, allow_pickle)
        data = Path(path).read_bytes()
        digest = new_hash()
        digest.update(data)
        if digest.hexdigest() != expected:
            raise CheckpointDamagedError(f"{path}: expected {HASH_NAME} {expected}, found {digest.hexdigest()} "
                                         f"(changed after the checkpoint was verified)")
        return load_checkpoint_file(io.BytesIO(data), map_location, allow_pickle, label=path)
