"""StagedFileWriter: bytes copied into aligned staging blocks, written by O_DIRECT (or plainly where
refused), the file truncated to its true size and hashed as a plain write would be."""

import errno
import os

import pytest

from lazyzero.checkpoint import durable_io
from lazyzero.checkpoint.snapshot import BufferBudget
from lazyzero.checkpoint.staged_io import DIRECT_ALIGNMENT, StagedFileWriter, StagingBlocks

BLOCK = 64 << 10


def _write(path, chunks, blocks):
    writer = StagedFileWriter(path, blocks)
    for chunk in chunks:
        writer.write(chunk)
    writer.sync_and_close()
    return writer


@pytest.mark.parametrize("sizes", [[1], [BLOCK], [BLOCK - 1, 2], [3 * BLOCK + 17, 5, DIRECT_ALIGNMENT]])
def test_file_holds_exactly_the_bytes_written_with_their_hash(tmp_path, sizes):
    blocks = StagingBlocks(BufferBudget(None), block_bytes=BLOCK)
    chunks = [os.urandom(n) for n in sizes]
    writer = _write(tmp_path / "f.bin", chunks, blocks)
    data = b"".join(chunks)
    assert (tmp_path / "f.bin").read_bytes() == data and writer.size == len(data)
    digest = durable_io.new_hash()
    digest.update(data)
    assert writer.digest() == digest.hexdigest() == durable_io.hash_file(tmp_path / "f.bin")[1]
    blocks.close()


def test_blocks_are_reused_and_the_budget_bounds_them(tmp_path):
    budget = BufferBudget(2 * BLOCK)
    blocks = StagingBlocks(budget, block_bytes=BLOCK)
    data = os.urandom(7 * BLOCK + 3)
    _write(tmp_path / "a.bin", [data], blocks)
    _write(tmp_path / "b.bin", [data], blocks)
    assert (tmp_path / "a.bin").read_bytes() == data == (tmp_path / "b.bin").read_bytes()
    assert budget.used_bytes == 2 * BLOCK
    blocks.close()


def test_an_error_of_a_block_write_is_raised_by_the_next_write_or_the_sync(tmp_path, monkeypatch):
    monkeypatch.setenv("LAZYZERO_IO_FAULT", "write:1:EIO")
    from lazyzero.checkpoint import faults
    monkeypatch.setattr(faults, "_io_calls", type(faults._io_calls)())
    blocks = StagingBlocks(BufferBudget(None), block_bytes=BLOCK)
    writer = StagedFileWriter(tmp_path / "f.bin", blocks)
    writer.write(os.urandom(BLOCK))  # a full block: its write fails on the I/O thread
    with pytest.raises(OSError) as raised:
        writer.sync_and_close()
    assert raised.value.errno == errno.EIO and "injected by LAZYZERO_IO_FAULT" in str(raised.value)
    writer.close()
    blocks.close()


def test_a_filesystem_refusing_o_direct_at_the_write_gets_plain_writes(tmp_path, monkeypatch):
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        import fcntl
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    blocks = StagingBlocks(BufferBudget(None), block_bytes=BLOCK)
    data = os.urandom(2 * BLOCK + 5)
    _write(tmp_path / "f.bin", [data], blocks)
    assert refused and (tmp_path / "f.bin").read_bytes() == data
    blocks.close()
