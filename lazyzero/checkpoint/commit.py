"""Writing one rank's files, and the commit of a whole checkpoint by rank 0 (docs/reliability.md, guarantee 1).

Order of a commit: every rank writes its files in the temporary folder (the host-resident ones
before the next optimizer step, lazy_engine.py), then fsyncs them; once all ranks
report success, rank 0 writes the manifest (size and hash of every file), renames the temporary
folder to the tag, fsyncs `save_dir`, then replaces `latest` by a renamed temporary file. A crash at
any point leaves either the previous checkpoint as `latest` or the new one complete.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from lazyzero.checkpoint.durable_io import durable_rename, fsync_dir, remove_tree, write_file_atomically
from lazyzero.checkpoint.faults import failpoint
from lazyzero.checkpoint.folder_layout import LATEST_NAME, latest_text, temp_dir, trash_dir
from lazyzero.checkpoint.manifest import Manifest, committed_tags
from lazyzero.checkpoint.snapshot import FileSnapshot
from lazyzero.checkpoint.staged_io import StagedFileWriter, StagingBlocks
from lazyzero.checkpoint.zip_crc import without_zip_crc


@dataclass
class WrittenFile:
    """A file of this rank written into the temporary folder, its descriptor still open for the fsync."""

    relpath: str
    path: Path
    writer: StagedFileWriter


def write_file(snap: FileSnapshot, folder: Path, fail_midway: bool, blocks: StagingBlocks) -> WrittenFile:
    """Write one snapshot file into `folder` through staging blocks: when this returns its bytes are
    copied out of the state; `make_durable` waits for the disk and fsyncs."""
    path = folder / snap.relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = StagedFileWriter(path, blocks, fail_midway_at=max(1, snap.nbytes // 2) if fail_midway else None)
    try:
        if snap.raw is not None:
            writer.write(memoryview(snap.raw.numpy()))
        else:
            with without_zip_crc():  # the manifest's hash covers every byte, at a tenth of the CPU time
                torch.save(snap.state, writer)
    except BaseException as err:
        writer.close()
        path.unlink(missing_ok=True)
        if writer.error is not None and err is not writer.error:
            raise writer.error from err
        raise
    return WrittenFile(snap.relpath, path, writer)


def write_files(files: list[FileSnapshot], folder: Path, pool: ThreadPoolExecutor, blocks: StagingBlocks,
                fail_midway_in: FileSnapshot | None = None) -> list[WrittenFile]:
    """Write `files` in parallel into `folder`; `fail_midway_in` is the file whose middle fires the
    'mid_file' failpoint. On any failure the files already written are removed before the error
    propagates."""
    futures = [pool.submit(write_file, snap, folder, snap is fail_midway_in, blocks) for snap in files]
    written, first_error = [], None
    for future in futures:
        try:
            written.append(future.result())
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the cleanup
            first_error = first_error or err
    if first_error is not None:
        discard_written(written)
        raise first_error
    return written


def make_durable(written: list[WrittenFile], rank: int, pool: ThreadPoolExecutor) -> dict[str, dict]:
    """fsync every written file (in parallel) and their folders; manifest entries by relpath.
    On a failure every file is closed and removed before the error propagates."""
    try:
        for future in [pool.submit(w.writer.sync_and_close) for w in written]:
            future.result()
        for parent in sorted({w.path.parent for w in written}, reverse=True):
            fsync_dir(parent)
    except BaseException:
        discard_written(written)
        raise
    return {w.relpath: {"size": w.writer.size, "hash": w.writer.digest(), "rank": rank} for w in written}


def discard_written(written: list[WrittenFile]) -> None:
    for w in written:
        w.writer.close()
        w.path.unlink(missing_ok=True)


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
    previous = latest_text(save_dir)
    try:
        write_file_atomically(save_dir / LATEST_NAME, tag.encode())
    except BaseException:
        if latest_text(save_dir) == tag:
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
    keep = {protect, latest_text(save_dir)}
    doomed = [t for t in tags[:-keep_last] if t not in keep]
    for tag in doomed:
        # Renamed first: a crash mid-delete leaves a trash folder, cleaned at start, not a damaged tag.
        durable_rename(save_dir / tag, trash_dir(save_dir, tag))
        remove_tree(trash_dir(save_dir, tag))
    return doomed


def discard_temp(save_dir: Path, tag: str) -> None:
    remove_tree(temp_dir(save_dir, tag))

