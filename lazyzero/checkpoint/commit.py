"""Writing one rank's files, and the commit of a whole checkpoint by rank 0 (RELIABILITY promise 1).

Order of a commit: every rank writes and fsyncs its files in the temporary folder; once all ranks
report success, rank 0 writes the manifest (size and hash of every file), renames the temporary
folder to the tag, fsyncs `save_dir`, then replaces `latest` by a renamed temporary file. A crash at
any point leaves either the previous checkpoint as `latest` or the new one complete.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lazyzero.checkpoint.durable_io import (HashingFileWriter, durable_rename, fsync_dir, remove_tree,
                                            write_file_atomically)
from lazyzero.checkpoint.faults import failpoint
from lazyzero.checkpoint.layout import LATEST_NAME, read_latest, temp_dir, trash_dir
from lazyzero.checkpoint.manifest import Manifest, committed_tags
from lazyzero.checkpoint.snapshot import FileSnapshot
from lazyzero.checkpoint.zip_crc import without_zip_crc


def write_file(snap: FileSnapshot, folder: Path, fail_midway: bool) -> tuple[str, int, str]:
    """Write one snapshot file into `folder` and fsync it; (relpath, size, hash)."""
    path = folder / snap.relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = HashingFileWriter(path, fail_midway_at=max(1, snap.nbytes // 2) if fail_midway else None)
    try:
        if snap.raw is not None:
            writer.write(memoryview(snap.raw.numpy()))
        else:
            with without_zip_crc():  # the manifest's hash covers every byte, at a tenth of the CPU time
                torch.save(snap.state, writer)
        writer.sync_and_close()
    except BaseException as err:
        writer.close()
        path.unlink(missing_ok=True)
        if writer.error is not None and err is not writer.error:
            raise writer.error from err
        raise
    return snap.relpath, writer.size, writer.digest()


def write_rank_files(files: list[FileSnapshot], folder: Path, rank: int, pool: ThreadPoolExecutor) -> dict[str, dict]:
    """Write this rank's files in parallel, fsync them and their folders; manifest entries by relpath.

    On any failure the files already written are removed before the error propagates."""
    futures = [pool.submit(write_file, snap, folder, i == 0) for i, snap in enumerate(files)]
    written, first_error = {}, None
    for future in futures:
        try:
            relpath, size, digest = future.result()
            written[relpath] = {"size": size, "hash": digest, "rank": rank}
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the cleanup
            first_error = first_error or err
    if first_error is not None:
        for relpath in written:
            (folder / relpath).unlink(missing_ok=True)
        raise first_error
    for parent in sorted({(folder / relpath).parent for relpath in written}, reverse=True):
        fsync_dir(parent)
    return written


def commit_on_rank0(save_dir: Path, manifest: Manifest, save_latest: bool, keep_last: int | None) -> list[str]:
    """Manifest, rename into place, 'latest', retention. Returns the tags deleted by retention."""
    folder = temp_dir(save_dir, manifest.tag)
    final = save_dir / manifest.tag
    manifest.write(folder)
    failpoint("after_manifest")
    if final.exists():  # the same tag saved again: the new one replaces it whole
        durable_rename(final, trash_dir(save_dir, manifest.tag))
    durable_rename(folder, final)
    remove_tree(trash_dir(save_dir, manifest.tag))
    failpoint("after_rename")
    if save_latest:
        advance_latest(save_dir, manifest.tag)
    failpoint("after_latest")
    return apply_retention(save_dir, keep_last, protect=manifest.tag)


def advance_latest(save_dir: Path, tag: str) -> None:
    """Point 'latest' at `tag`. If that fails after the rename (the fsync of save_dir), 'latest' is
    put back: a failed save never leaves 'latest' naming its checkpoint."""
    previous = read_latest(save_dir)
    try:
        write_file_atomically(save_dir / LATEST_NAME, tag.encode())
    except BaseException:
        if read_latest(save_dir) == tag:
            _put_back_latest(save_dir, previous)
        raise


def _put_back_latest(save_dir: Path, previous: str | None) -> None:
    try:
        if previous is None:
            (save_dir / LATEST_NAME).unlink(missing_ok=True)
        else:
            write_file_atomically(save_dir / LATEST_NAME, previous.encode())
    except OSError:
        pass  # the original error is the one to report; the load falls back to a committed tag anyway


def apply_retention(save_dir: Path, keep_last: int | None, protect: str) -> list[str]:
    """Delete committed checkpoints older than the newest `keep_last` (never `protect` or 'latest')."""
    if keep_last is None:
        return []
    tags = committed_tags(save_dir)
    keep = {protect, read_latest(save_dir)}
    doomed = [t for t in tags[:-keep_last] if t not in keep]
    for tag in doomed:
        # Renamed first: a crash mid-delete leaves a trash folder, cleaned at start, not a damaged tag.
        durable_rename(save_dir / tag, trash_dir(save_dir, tag))
        remove_tree(trash_dir(save_dir, tag))
    return doomed


def discard_temp(save_dir: Path, tag: str) -> None:
    remove_tree(temp_dir(save_dir, tag))

