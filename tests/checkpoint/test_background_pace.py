"""BackgroundPace: background copies wait while training's window is closed and keep to their rate;
the lazy engine closes the window over the optimizer step and, under ZeRO-3, over forward gathers."""

import threading
import time

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from lazyzero.checkpoint.background_pace import BURST_S, BackgroundPace, copy_bandwidth, paced_copy
from lazyzero.checkpoint.config import CheckpointConfig
from lazyzero.checkpoint.lazy_engine import LazyCheckpointEngine
from lazyzero.checkpoint.manifest import verify_checkpoint

PATIENCE_S = 30.0  # what a released waiter may take on a loaded CI machine; never a measured speed


def _admit_in_thread(pace: BackgroundPace, nbytes: int) -> threading.Event:
    admitted = threading.Event()
    threading.Thread(target=lambda: (pace.admit(nbytes), admitted.set()), daemon=True).start()
    return admitted


def test_a_piece_waits_while_any_reason_keeps_the_window_closed():
    pace = BackgroundPace()
    pace.close("optimizer step")
    pace.close("gather")
    admitted = _admit_in_thread(pace, 1)
    assert not admitted.wait(0.2)
    pace.open("gather")
    assert not admitted.wait(0.2)  # the step still holds it
    pace.open("optimizer step")
    assert admitted.wait(PATIENCE_S) and pace.is_open


def test_closes_for_one_reason_pair_up_and_open_all_releases_everything():
    pace = BackgroundPace()
    pace.close("gather")
    pace.close("gather")  # a module gathered inside another's forward
    pace.open("gather")
    assert not pace.is_open
    admitted = _admit_in_thread(pace, 1)
    pace.open_all()
    assert admitted.wait(PATIENCE_S) and pace.is_open


def test_a_rate_admits_no_more_bytes_than_it_allows():
    rate = 50e6
    pace = BackgroundPace(rate)
    pieces, piece = 20, 512 << 10
    started = time.monotonic()
    for _ in range(pieces):
        pace.admit(piece)
    elapsed = time.monotonic() - started
    # A lower bound only: the limiter sleeps at least this long; how much longer depends on the machine.
    assert elapsed >= pieces * piece / rate - 2 * BURST_S
    assert pace.waited_s >= elapsed * 0.5


def test_paced_copy_copies_contiguous_sources_in_pieces_and_strided_ones_whole():
    class CountingPace(BackgroundPace):
        def __init__(self):
            super().__init__(1e12)
            self.pieces = []

        def admit(self, nbytes):
            self.pieces.append(nbytes)
            super().admit(nbytes)

    source = torch.arange(1000, dtype=torch.float32)
    target, pace = torch.empty(1000), CountingPace()
    paced_copy(target, source, pace, piece_bytes=1024)
    assert torch.equal(target, source) and pace.pieces == [1024] * 3 + [4000 - 3 * 1024]
    strided, pace = torch.empty(500), CountingPace()
    paced_copy(strided, source[::2], pace, piece_bytes=1024)
    assert torch.equal(strided, source[::2]) and pace.pieces == [2000]


def test_copy_bandwidth_is_measured_once_and_positive():
    assert copy_bandwidth() > 0 and copy_bandwidth() is copy_bandwidth()


def test_writes_wait_for_the_optimizer_step_to_end_and_the_commit_follows(tmp_path):
    engine = LazyCheckpointEngine(CheckpointConfig(enabled=True, copy_bandwidth_share=0.5), rank=0, world_size=1,
                                  on_cuda=False)
    assert engine.pace.bytes_per_s == 0.5 * copy_bandwidth()
    weights = torch.arange(4096, dtype=torch.float32)
    engine.prepare(str(tmp_path), save_latest=True, global_steps=1, barrier=lambda: None)
    info = CheckpointCommitInfo(tag="step1", save_dir=str(tmp_path), save_latest=False)
    engine.create(info)
    # A view only: copied into a host buffer before the step, its file written by the flush thread after.
    engine.save({"view": weights[10:20]}, str(tmp_path / "step1" / "model_states.pt"))
    engine.commit(info)
    (checkpoint,) = engine.pending()
    engine.before_optimizer_step()  # the snapshot is taken; the window closes for the step
    weights.zero_()
    assert not engine.pace.is_open and not checkpoint.done.wait(0.5)  # the file's write is held back
    engine.after_optimizer_step()
    assert checkpoint.done.wait(PATIENCE_S)
    engine.close()
    verify_checkpoint(tmp_path / "step1")
    assert torch.equal(torch.load(tmp_path / "step1" / "model_states.pt")["view"],
                       torch.arange(10, 20, dtype=torch.float32))


def test_a_wait_opens_a_window_a_failed_step_left_closed(tmp_path):
    engine = LazyCheckpointEngine(CheckpointConfig(enabled=True), rank=0, world_size=1, on_cuda=False)
    engine.before_optimizer_step()  # the step then raises: no after_optimizer_step
    engine.wait()
    assert engine.pace.is_open
    engine.close()
