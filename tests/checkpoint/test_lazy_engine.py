"""LazyCheckpointEngine in one process (no process group): the calls DeepSpeed's save_checkpoint
makes, in its order, then what is on disk; the host-buffer limit; the background threads' priority;
and, on CUDA, copies on the side stream overlapping compute issued after the save returned."""

import ctypes
import errno
import os
import sys
import threading

import pytest
import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from lazyzero.checkpoint import idle_priority
from lazyzero.checkpoint.config import CheckpointConfig
from lazyzero.checkpoint.folder_layout import read_latest
from lazyzero.checkpoint.idle_priority import IDLE, IOPRIO_CLASS_IDLE, NORMAL, thread_io_class
from lazyzero.checkpoint.lazy_engine import LazyCheckpointEngine
from lazyzero.checkpoint.manifest import verify_checkpoint
from lazyzero.checkpoint.snapshot import HostBufferLimitError
from lazyzero.checkpoint.staged_io import BLOCK_BYTES


def _engine(on_cuda=False, **config) -> LazyCheckpointEngine:
    return LazyCheckpointEngine(CheckpointConfig(enabled=True, **config), rank=0, world_size=1, on_cuda=on_cuda)


def _save(engine, save_dir, tag, state, step=1):
    """What DeepSpeedEngine.save_checkpoint does with a checkpoint engine, for one file."""
    engine.prepare(str(save_dir), save_latest=True, global_steps=step, barrier=lambda: None)
    info = CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=False)
    engine.create(info)
    engine.makedirs(str(save_dir / tag), exist_ok=True)
    engine.save(state, str(save_dir / tag / "model_states.pt"))
    engine.commit(info)


def test_saved_file_holds_the_state_at_save_time_not_after_the_next_update(tmp_path):
    engine = _engine()
    weights = torch.arange(1000, dtype=torch.float32)
    _save(engine, tmp_path, "step1", {"module": {"w": weights, "shape": torch.Size([1000])}, "step": 1})
    engine.before_optimizer_step()  # what the engine calls before the optimizer changes the state
    weights.add_(1)
    engine.wait()
    manifest = verify_checkpoint(tmp_path / "step1")
    assert manifest.global_steps == 1 and read_latest(tmp_path) == "step1"
    saved = torch.load(tmp_path / "step1" / "model_states.pt", weights_only=False)
    assert torch.equal(saved["module"]["w"], torch.arange(1000, dtype=torch.float32))
    assert type(saved["module"]["shape"]) is torch.Size  # zero_to_fp32 calls shape.numel()
    engine.close()


def test_buffers_over_the_host_limit_are_refused_naming_the_key(tmp_path):
    engine = _engine(host_buffer_limit=BLOCK_BYTES + 4096)  # one staging block and 4 KiB of buffers
    flat = torch.zeros(BLOCK_BYTES // 4 + 4096)
    with pytest.raises(HostBufferLimitError,
                       match=f"lazyzero.checkpoint.host_buffer_limit: {BLOCK_BYTES + 4096} bytes"):
        _save(engine, tmp_path, "step1", {"w": flat[:BLOCK_BYTES // 4 + 2048]})  # a view: a buffer over the limit
    engine.abandon()
    _save(engine, tmp_path, "step2", {"w": flat[:10]})  # the slot came back
    engine.close()
    verify_checkpoint(tmp_path / "step2")


def test_whole_host_tensors_are_written_from_training_memory_before_the_step_and_views_are_copied(tmp_path):
    engine = _engine(host_buffer_limit=BLOCK_BYTES + 1000)  # one staging block; only the view may take a buffer
    flat, moment = torch.arange(100, dtype=torch.float32), torch.full((4096,), 2.0)
    _save(engine, tmp_path, "step1", {"view": flat[10:20], "moment": moment, "tied": moment})
    engine.before_optimizer_step()
    flat.zero_(), moment.zero_()  # the step: the file must hold the state of the save
    engine.wait()
    saved = torch.load(tmp_path / "step1" / "model_states.pt", weights_only=False)
    assert (torch.equal(saved["view"], torch.arange(10, 20, dtype=torch.float32))
            and saved["view"].untyped_storage().nbytes() == 40)
    assert torch.equal(saved["moment"], torch.full((4096,), 2.0)) and saved["tied"] is saved["moment"]
    assert engine._free_slots.queue[0]._budget.used_bytes == 40 + BLOCK_BYTES  # the view's buffer and the block
    engine.close()


def test_a_state_larger_than_the_limit_streams_through_the_staging_blocks(tmp_path):
    engine = _engine(host_buffer_limit=2 * BLOCK_BYTES)
    state = {"w": torch.randn(5 * BLOCK_BYTES // 4 + 123)}  # five blocks and a bit, through two
    expected = state["w"].clone()
    _save(engine, tmp_path, "step1", state)
    engine.before_optimizer_step()
    state["w"].zero_()
    engine.close()
    manifest = verify_checkpoint(tmp_path / "step1")
    assert torch.equal(torch.load(tmp_path / "step1" / "model_states.pt")["w"], expected)
    assert manifest.files["model_states.pt"]["size"] == (tmp_path / "step1" / "model_states.pt").stat().st_size
    assert engine._staging._budget.used_bytes <= 2 * BLOCK_BYTES


@pytest.mark.gpu
def test_cuda_copies_run_on_a_side_stream_while_compute_runs(tmp_path):
    engine = _engine(on_cuda=True)
    state = {"w": torch.randn(64 << 20, device="cuda")}  # 256 MiB: a copy long enough to see
    expected = state["w"].cpu()
    x = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    copy_start, copy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    copy_start.record(engine._side_stream)
    _save(engine, tmp_path, "step1", state)
    copy_end.record(engine._side_stream)
    compute_start, compute_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    compute_start.record()
    for _ in range(20):
        x = torch.tanh(x @ x)
    compute_end.record()
    engine.before_optimizer_step()
    state["w"].zero_()
    engine.wait()
    torch.cuda.synchronize()
    assert copy_start.elapsed_time(compute_end) > 0 and compute_start.elapsed_time(copy_end) > 0, "no overlap"
    saved = torch.load(tmp_path / "step1" / "model_states.pt", weights_only=False)
    assert torch.equal(saved["w"], expected)
    engine.close()


def test_keep_last_deletes_older_committed_checkpoints_and_keeps_latest(tmp_path):
    engine = _engine(keep_last=2)
    for step in range(1, 5):
        _save(engine, tmp_path, f"step{step}", {"w": torch.full((10,), float(step))}, step=step)
        engine.wait()
    engine.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step3", "step4"]
    assert read_latest(tmp_path) == "step4"
    verify_checkpoint(tmp_path / "step3")


def test_commit_figures_count_the_background_threads_cpu_and_the_waits(tmp_path):
    """bench_checkpoint reports these beside the wall-clock stall: they do not drift with the host."""
    engine = _engine()
    state = {"w": torch.randn(8 * 2**20)}  # 32 MiB to hash and write: well over the clocks' 10 ms tick
    _save(engine, tmp_path, "step1", state)
    engine.before_optimizer_step()
    engine.wait()
    first = engine.last_commit
    assert first["tag"] == "step1" and first["slot_wait_s"] < 0.05
    assert 0.01 <= first["background_cpu_s"] <= 4 * first["queued_to_committed_s"] + 0.02
    assert 0 <= first["step_wait_s"] <= first["queued_to_committed_s"]
    engine.close()


BACKGROUND_THREADS = {"lazyzero-ckpt-copy", "lazyzero-ckpt-flush", "lazyzero-ckpt-writer", "lazyzero-ckpt-io"}
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_IDLE and ioprio are Linux's")


def _save_through_every_thread(engine, save_dir) -> dict:
    """A save whose file passes through the copy, writer and I/O threads (three staging blocks) and
    the flush thread; the priorities the threads recorded, each by its pool's name."""
    _save(engine, save_dir, "step1", {"w": torch.randn(3 * BLOCK_BYTES // 4)})
    engine.before_optimizer_step()
    engine.wait()
    verify_checkpoint(save_dir / "step1")
    priorities = dict(engine.thread_priorities)
    assert {name.rsplit("_", 1)[0] for name in priorities} == BACKGROUND_THREADS
    return priorities


@linux_only
def test_background_threads_run_in_the_idle_classes_and_the_training_thread_does_not(tmp_path):
    training_policy = os.sched_getscheduler(0)
    if training_policy == os.SCHED_IDLE:
        pytest.skip("the test process already runs at idle priority")
    engine = _engine()
    for name, priority in _save_through_every_thread(engine, tmp_path).items():
        assert (priority.cpu, priority.io, priority.reason) == (IDLE, IDLE, None), name
        # Read by the kernel from this thread, not as the background thread reported it.
        assert os.sched_getscheduler(priority.native_id) == os.SCHED_IDLE, name
        assert thread_io_class(priority.native_id) == IOPRIO_CLASS_IDLE, name
    assert os.sched_getscheduler(0) == training_policy
    assert thread_io_class(threading.get_native_id()) != IOPRIO_CLASS_IDLE
    engine.close()


@linux_only
def test_background_priority_normal_leaves_the_threads_at_training_priority(tmp_path):
    training_policy = os.sched_getscheduler(0)
    engine = _engine(background_priority="normal")
    for name, priority in _save_through_every_thread(engine, tmp_path).items():
        assert (priority.cpu, priority.io) == (NORMAL, NORMAL), name
        assert priority.reason == "lazyzero.checkpoint.background_priority: normal"
        assert os.sched_getscheduler(priority.native_id) == training_policy, name
        assert thread_io_class(priority.native_id) != IOPRIO_CLASS_IDLE, name
    engine.close()


def test_a_platform_that_refuses_idle_priority_still_commits(tmp_path, monkeypatch):
    def refused_scheduler(*args):
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

    def refused_syscall(*args):
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(os, "sched_setscheduler", refused_scheduler, raising=False)
    monkeypatch.setattr(idle_priority, "_syscall", refused_syscall)
    engine = _engine()
    for name, priority in _save_through_every_thread(engine, tmp_path).items():
        assert (priority.cpu, priority.io) == (NORMAL, NORMAL), name
        assert "refused" in priority.reason or "not offered" in priority.reason, name
    engine.close()
