"""Checkpoint files written through aligned staging blocks and O_DIRECT.

A lazy snapshot must be taken before the next optimizer step, and on this kind of machine the page
cache is the wrong place to take it: past the kernel's dirty limits (a fifth of free memory by
default) a buffered write runs at the disk's pace, so a 1.2 GB rank state made the step wait for
the disk, and every byte costs a second, kernel-side copy on the cores training needs. Here
`write` only copies the bytes into reused page-aligned blocks (a memcpy at memory speed: this copy
is the snapshot) and hashes them; an I/O thread writes each full block with O_DIRECT (the device
reads it by DMA, no page-cache copy, no dirty-page throttling) and hands the block back. The last
block is written padded to the alignment, and the file is truncated to its true size before the
fsync. Where the filesystem refuses O_DIRECT (tmpfs, some network filesystems) the same blocks are
written with plain writes.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from lazyzero.checkpoint import durable_io
from lazyzero.checkpoint.background_pace import BackgroundPace
from lazyzero.checkpoint.config import STAGING_BLOCK_BYTES
from lazyzero.checkpoint.snapshot import BufferBudget, HostBufferLimitError

BLOCK_BYTES = STAGING_BLOCK_BYTES  # large sequential writes; small enough that a file's tail wastes little
DIRECT_ALIGNMENT = 4096  # offset, length and address alignment accepted by O_DIRECT on common devices
HASH_PIECE_BYTES = 512 << 10  # copied, then hashed while still in the core's L2
IO_THREADS = 2  # two writes in flight keep a device busy; the copies are the CPU's work, not these threads


class StagingBlocks:
    """Page-aligned blocks drawn from the snapshot budget, reused across checkpoints, and the threads
    that write them (`io_pool`). At the budget's limit a writer waits for a block the disk is done
    with (the snapshot then runs at the disk's pace); the limit must leave room for one block.
    `thread_start` runs first in each I/O thread (the engine's: its priority and CPU clock); `pace`
    admits each piece copied into a block (background_pace.py)."""

    def __init__(self, budget: BufferBudget, io_threads: int = IO_THREADS, block_bytes: int = BLOCK_BYTES,
                 thread_start: Callable[[], None] | None = None, pace: BackgroundPace | None = None):
        self.block_bytes = block_bytes
        self.pace = pace
        self.io_pool = ThreadPoolExecutor(io_threads, thread_name_prefix="lazyzero-ckpt-io", initializer=thread_start)
        self._budget = budget
        self._free: list[mmap.mmap] = []
        self._allocated = 0
        self._returned = threading.Condition()

    def take(self) -> mmap.mmap:
        with self._returned:
            while not self._free:
                if self._budget.try_reserve(self.block_bytes):
                    self._allocated += 1
                    return mmap.mmap(-1, self.block_bytes)  # anonymous: page-aligned
                if self._allocated == 0:
                    raise HostBufferLimitError(
                        f"lazyzero.checkpoint.host_buffer_limit: {self._budget.limit_bytes} bytes leaves no room for "
                        f"one {self.block_bytes}-byte staging block beside the snapshot's other buffers; raise it")
                self._returned.wait()
            return self._free.pop()

    def give_back(self, block: mmap.mmap) -> None:
        with self._returned:
            self._free.append(block)
            self._returned.notify()

    def close(self) -> None:
        self.io_pool.shutdown(wait=True)


class StagedFileWriter(durable_io.HashingFileWriter):
    """HashingFileWriter whose `write` copies into staging blocks; full blocks go to disk on the I/O pool.
    An error of a block's write is kept and raised by the next `write` or by `sync_and_close`."""

    def __init__(self, path, blocks: StagingBlocks, fail_midway_at: int | None = None):
        super().__init__(path, fail_midway_at, direct=True)
        self._blocks = blocks
        self._block: mmap.mmap | None = None
        self._filled = 0  # bytes in the current block
        self._block_offset = 0  # file offset of the current block
        self._writes: list[Future] = []

    def _put(self, view: memoryview) -> int:
        self._raise_block_error()
        done = 0
        while done < view.nbytes:
            if self._block is None:
                self._block = self._blocks.take()
            n = min(view.nbytes - done, self._blocks.block_bytes - self._filled, HASH_PIECE_BYTES)
            if self._blocks.pace is not None:
                self._blocks.pace.admit(n)
            staged = np.frombuffer(self._block, np.uint8, n, self._filled)
            np.copyto(staged, np.frombuffer(view, np.uint8, n, done))  # releases the GIL, unlike a slice assignment
            self._hash.update(staged)  # while the piece is still in cache: one pass over memory, not two
            self._filled += n
            done += n
            if self._filled == self._blocks.block_bytes:
                self._submit_block()
        return done

    def sync_and_close(self) -> None:
        if self._filled:
            self._submit_block()
        for future in self._writes:
            future.exception()  # wait for every block; the first error is kept by _write_block
        self._raise_block_error()
        os.ftruncate(self.fd, self.size)  # the tail block was written padded to the alignment
        super().sync_and_close()

    def close(self) -> None:
        for future in self._writes:
            future.exception()  # no block may still be in the I/O pool when the descriptor closes
        if self._block is not None:
            self._blocks.give_back(self._block)
            self._block = None
        super().close()

    def _submit_block(self) -> None:
        block, length, offset = self._block, self._filled, self._block_offset
        self._block, self._filled, self._block_offset = None, 0, offset + length
        self._writes.append(self._blocks.io_pool.submit(self._write_block, block, length, offset))

    def _write_block(self, block: mmap.mmap, length: int, offset: int) -> None:
        try:
            if self.error is None:
                durable_io.io_fault("write", self.path)
                padded = -(-length // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
                view = memoryview(block)[:padded]
                written = 0
                while written < padded:
                    written += self._pwrite(view[written:], offset + written)
        except OSError as err:
            self.error = self.error or err
        finally:
            self._blocks.give_back(block)

    def _pwrite(self, view: memoryview, offset: int) -> int:
        try:
            return os.pwrite(self.fd, view, offset)
        except OSError as err:
            if err.errno != errno.EINVAL or not fcntl.fcntl(self.fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
                raise
            # Opened with O_DIRECT but refused at the write: the plain path, for the rest of this file.
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            return os.pwrite(self.fd, view, offset)

    def _raise_block_error(self) -> None:
        if self.error is not None:
            raise self.error

