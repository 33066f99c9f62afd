"""Writing files so that a crash leaves either the old state or the new one (docs/reliability.md, guarantee 1).

Every write, fsync and rename of the checkpoint path goes through here, which is also where faults
are injected (`faults.io_fault`) and where each file's hash is computed while it is written: the
bytes are hashed once, in memory, instead of read back.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable

import xxhash

from lazyzero.checkpoint.faults import failpoint, io_fault

HASH_NAME = "xxh3_128"


def new_hash():
    """xxh3-128: ~20 GB/s on one core here (sha256 would cost more CPU than the copy itself), and
    128 bits make an undetected random corruption astronomically unlikely."""
    return xxhash.xxh3_128()


class HashingFileWriter(io.RawIOBase):
    """A write-only file that hashes and counts what it writes, writes straight to the descriptor
    (torch.save hands over each tensor's bytes in one call, so writes are already large and
    sequential), and fsyncs before close. `fail_midway_at` fires the 'mid_file' failpoint once that
    many bytes are written."""

    def __init__(self, path: str | os.PathLike, fail_midway_at: int | None = None, direct: bool = False):
        super().__init__()
        self.path = str(path)
        self.fd = _open_for_writing(self.path, direct)
        self.size = 0
        self.error: OSError | None = None
        self._hash = new_hash()
        self._fail_midway_at = fail_midway_at

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._put(view)
        except OSError as err:
            # torch.save's zip writer replaces an error from its sink with an 'unexpected pos'
            # RuntimeError; the caller re-raises this one so the report says disk full / I/O error.
            self.error = err
            raise
        self.size += written
        if self._fail_midway_at is not None and self.size >= self._fail_midway_at:
            self._fail_midway_at = None  # once per file: 'mid_file#N' counts files, not writes
            failpoint("mid_file")
        return written

    def _put(self, view: memoryview) -> int:
        """Write and hash `view`; the bytes written."""
        io_fault("write", self.path)
        written = 0
        while written < view.nbytes:
            written += os.write(self.fd, view[written:])
        self._hash.update(view)
        return written

    def digest(self) -> str:
        return self._hash.hexdigest()

    def sync_and_close(self) -> None:
        fsync_fd(self.fd, self.path)
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)
        super().close()


def _open_for_writing(path: str, direct: bool) -> int:
    """A new, empty file; with O_DIRECT when `direct` and the filesystem accepts it (tmpfs may not)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644)


def fsync_fd(fd: int, path: str) -> None:
    io_fault("fsync", path)
    os.fsync(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(str(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync_fd(fd, str(path))
    finally:
        os.close(fd)


def durable_rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst` (replacing a file, not a non-empty folder) and fsync the parent."""
    io_fault("rename", str(dst))
    os.replace(src, dst)
    fsync_dir(Path(dst).parent)


def write_file_atomically(path: str | os.PathLike, data: bytes) -> str:
    """Write `data` to `path` by a temporary file, fsync and rename; returns the data's hash."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    writer = HashingFileWriter(partial)
    try:
        writer.write(data)
        writer.sync_and_close()
        durable_rename(partial, path)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    return writer.digest()


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a folder that may be half written; a missing folder is fine. A symbolic link is removed
    itself, never what it points to."""
    if os.path.islink(path):
        with contextlib.suppress(OSError):  # as rmtree's ignore_errors
            os.unlink(path)
        return
    shutil.rmtree(path, ignore_errors=True)


def hash_file(path: str | os.PathLike, chunk_bytes: int = 8 << 20,
              on_bytes: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, hash) of a file as it is on disk now; `on_bytes(n)` after each chunk (progress bars)."""
    with open(path, "rb", buffering=0) as f:
        return hash_stream(f, chunk_bytes, on_bytes)


def hash_stream(f: BinaryIO, chunk_bytes: int = 8 << 20,
                on_bytes: Callable[[int], None] | None = None) -> tuple[int, str]:
    """(size, hash) of what is left to read in the open file `f`; `on_bytes(n)` after each chunk."""
    digest = new_hash()
    size = 0
    buffer = bytearray(max(1, min(chunk_bytes, os.fstat(f.fileno()).st_size)))
    view = memoryview(buffer)
    while True:
        n = f.readinto(buffer)
        if not n:
            break
        digest.update(view[:n])
        size += n
        if on_bytes is not None:
            on_bytes(n)
    return size, digest.hexdigest()


# What a checkpoint file takes beyond its tensors' bytes: torch.save's zip records and pickle, and the
# filesystem's rounding up to its block (4 KiB on the common ones).
FILE_OVERHEAD_BYTES = 4096


def check_free_space(folder: str | os.PathLike, needed_bytes: int) -> None:
    """Raise OSError(ENOSPC) naming `folder`, the bytes needed and the bytes free when the filesystem
    holding `folder` has less room than `needed_bytes` for an unprivileged writer (docs/reliability.md,
    guarantee 4: a save that cannot fit fails before it writes anything)."""
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    if needed_bytes > free:
        raise OSError(errno.ENOSPC, f"not enough space for this rank's checkpoint files: {needed_bytes:,} bytes "
                                    f"needed, {free:,} free on the filesystem of {folder}")
