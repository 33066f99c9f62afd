"""`LazyCheckpointEngine`: DeepSpeed's checkpoint engine interface, with saves that cost (almost) nothing.

DeepSpeed's `save_checkpoint` calls `create`, `makedirs`, `save` per file and `commit`; here `save`
only records the snapshot to take (snapshot.py), `commit` queues the checkpoint and returns.
Per checkpoint, in the background:
  1. the snapshot (copy thread; side stream on CUDA): device tensors and views copied into reused
     host buffers, and the files that hold host tensors written into the temporary folder straight
     from them; the next optimizer step waits for this (`before_optimizer_step`), since it is what
     changes the state, but never for an fsync;
  2. a flush thread writes the remaining files (writer pool) and fsyncs every file;
  3. all ranks agree on a side gloo group (each rank's files and hashes, or its error); rank 0
     commits (commit.py) and broadcasts the outcome.
Every one of these threads runs in the idle CPU and I/O classes (idle_priority.py), so training's
threads preempt them. A failure anywhere is kept and raised on this rank's next save, wait or
optimizer step (docs/reliability.md, guarantee 4); the temporary data is removed and `latest` is not
advanced.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from lazyzero.checkpoint.background_clocks import BackgroundClocks
from lazyzero.checkpoint.background_pace import BackgroundPace, copy_bandwidth
from lazyzero.checkpoint.commit import (
    WrittenFile,
    commit_on_rank0,
    discard_temp,
    discard_written,
    make_durable,
    write_files,
)
from lazyzero.checkpoint.durable_io import FILE_OVERHEAD_BYTES, check_free_space, remove_tree
from lazyzero.checkpoint.faults import failpoint
from lazyzero.checkpoint.folder_layout import check_tag, leftover_dirs, temp_dir
from lazyzero.checkpoint.idle_priority import NORMAL, ThreadPriority, lower_current_thread
from lazyzero.checkpoint.manifest import Manifest
from lazyzero.checkpoint.snapshot import (
    BufferBudget,
    FileSnapshot,
    HostBuffers,
    run_copies,
    snapshot_file,
    snapshot_host_bytes,
    snapshot_state,
    start_device_copies,
)
from lazyzero.checkpoint.staged_io import StagingBlocks
from lazyzero.checkpoint.verified_read import VerifiedFiles
from lazyzero.config.models import DistributedConfig


class CheckpointFailedError(RuntimeError):
    """A background part of a lazy checkpoint failed; the checkpoint was not committed."""


class CheckpointWaitTimeout(CheckpointFailedError):
    """A queued checkpoint was not committed within the time the end of the job may wait for it."""


PROGRESS_EVERY_S = 10.0  # how often a long wait for a commit says what it waits for


@dataclass
class PendingCheckpoint:
    tag: str
    save_dir: Path
    save_latest: bool
    global_steps: int
    slot: HostBuffers
    files: list[FileSnapshot] = field(default_factory=list)
    copies_done: threading.Event = field(default_factory=threading.Event)
    cuda_copies: object = None  # torch.cuda.Event of the side-stream copies
    copy_error: BaseException | None = None
    written: list[WrittenFile] = field(default_factory=list)  # in the temporary folder, not yet fsynced
    done: threading.Event = field(default_factory=threading.Event)
    timings: dict = field(default_factory=dict)  # perf_counter marks: queued, copied, written, committed
    step_wait_s: float = 0.0  # how long optimizer steps (or a load) waited for this snapshot
    slot_wait_s: float = 0.0  # how long its save waited for a free buffer slot (an older checkpoint)
    background_cpu_start_s: float = 0.0  # CPU clock of the background threads when it was queued

    def write(self, files: list[FileSnapshot], pool: ThreadPoolExecutor, blocks: StagingBlocks) -> None:
        """Write some of this checkpoint's files into its temporary folder (the middle of its first
        file is the 'mid_file' failpoint)."""
        self.written += write_files(files, temp_dir(self.save_dir, self.tag), pool, blocks,
                                    fail_midway_in=self.files[0] if self.files else None)


class LazyCheckpointEngine(CheckpointEngine):
    """One per engine (rank). `config` is the validated `lazyzero.checkpoint` section; `timeout` bounds the
    flush threads' collectives (`lazyzero.distributed.timeout_s`)."""

    def __init__(self, config, rank: int, world_size: int, on_cuda: bool, verified: VerifiedFiles | None = None,
                 timeout: timedelta | None = None):
        super().__init__(None)
        self.verified = verified if verified is not None else VerifiedFiles()
        self.name = "LazyCheckpointEngine"
        self.config = config
        self.rank, self.world_size, self.on_cuda = rank, world_size, on_cuda
        budget = self._budget = BufferBudget(config.host_buffer_limit)
        self._free_slots: queue.Queue[HostBuffers] = queue.Queue()
        for _ in range(config.max_in_flight):
            self._free_slots.put(HostBuffers(budget, pin=on_cuda))
        self._group = _side_group(world_size, timeout)
        self._pending: list[PendingCheckpoint] = []
        self._current: PendingCheckpoint | None = None
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._cleaned_dirs: set[Path] = set()
        self._copy_queue: queue.Queue = queue.Queue()
        self._flush_queue: queue.Queue = queue.Queue()
        self._background_clocks = BackgroundClocks()
        # Thread name -> the priority that thread runs at, recorded by the thread itself as it starts.
        self.thread_priorities: dict[str, ThreadPriority] = {}
        self._writers = ThreadPoolExecutor(config.writer_threads, thread_name_prefix="lazyzero-ckpt-writer",
                                           initializer=self._start_background_thread)
        share = config.copy_bandwidth_share
        self.pace = BackgroundPace(None if share is None else share * copy_bandwidth())
        self._staging = StagingBlocks(budget, thread_start=self._start_background_thread, pace=self.pace)
        self._side_stream = torch.cuda.Stream() if on_cuda else None
        self._threads = [threading.Thread(target=self._copy_loop, name="lazyzero-ckpt-copy", daemon=True),
                         threading.Thread(target=self._flush_loop, name="lazyzero-ckpt-flush", daemon=True)]
        for thread in self._threads:
            thread.start()
        # This rank's figures of the newest committed checkpoint (bytes it wrote, seconds).
        self.last_commit: dict | None = None
        self.closed = False

    @property
    def holds_snapshot_memory(self) -> bool:
        """Whether a snapshot has taken host buffers or staging blocks (kept from then on)."""
        return self._budget.used_bytes > 0

    # --- called by LazyZeroEngine around DeepSpeed's save ---------------------------------------

    def prepare(self, save_dir: str, save_latest: bool, global_steps: int, barrier) -> None:
        """Before DeepSpeed's save: report earlier failures, clean leftovers once, take a buffer slot."""
        if self.closed:
            raise CheckpointFailedError("lazyzero: this engine's lazy checkpoints were closed (engine.destroy(), the "
                                        "process group destroyed, or the end of the job): it saves no more")
        self.raise_failures()
        self.clean_leftovers(save_dir, barrier)
        started = time.perf_counter()
        slot = self._take_slot()
        slot_wait_s = time.perf_counter() - started
        try:
            self.raise_failures()  # the checkpoint whose end freed the slot may have failed
        except CheckpointFailedError:
            self._free_slots.put(slot)
            raise
        self._current = PendingCheckpoint(tag="", save_dir=Path(save_dir), save_latest=save_latest,
                                          global_steps=global_steps, slot=slot, slot_wait_s=slot_wait_s)

    def abandon(self) -> None:
        """DeepSpeed's save raised before `commit`: drop the half-built snapshot, free its slot."""
        checkpoint, self._current = self._current, None
        if checkpoint is not None:
            if checkpoint.tag:
                discard_temp(checkpoint.save_dir, checkpoint.tag)
            self._free_slots.put(checkpoint.slot)

    def clean_leftovers(self, save_dir: str, barrier) -> None:
        """Rank 0 removes temporary folders of crashed runs (once per folder), then every rank goes on."""
        root = Path(save_dir).resolve()
        if root in self._cleaned_dirs:
            return
        if self.rank == 0:
            for leftover in leftover_dirs(root):
                print(f"lazyzero: removing {leftover}, left by an interrupted checkpoint", flush=True)
                remove_tree(leftover)
        barrier()
        self._cleaned_dirs.add(root)

    def add_raw_file(self, relpath: str, source: str) -> None:
        """A file copied byte for byte into the checkpoint being saved (NVMe swap files)."""
        self._current.files.append(snapshot_file(relpath, source, self._current.slot))

    def before_optimizer_step(self) -> None:
        """The optimizer is about to change the state: wait for unfinished copies (not writes), then
        hold the background writes back until `after_optimizer_step`."""
        self.wait_for_snapshots()
        self.pace.close("optimizer step")

    def after_optimizer_step(self) -> None:
        self.pace.open("optimizer step")

    def wait_for_snapshots(self) -> None:
        """Wait for unfinished copies (a load changes the state too). The host waits for the host's
        copies only; the device's work queued from now on waits for the side stream's, on the device."""
        for checkpoint in self.pending():
            started = time.perf_counter()
            checkpoint.copies_done.wait()
            if checkpoint.cuda_copies is not None:
                torch.cuda.current_stream().wait_event(checkpoint.cuda_copies)
            checkpoint.step_wait_s += time.perf_counter() - started
        self.raise_failures()

    def wait(self, timeout_s: float | None = None, progress=None) -> None:
        """Block until every queued checkpoint is committed or failed; raise a failure.
        `timeout_s` bounds the whole wait (CheckpointWaitTimeout names the checkpoint still queued);
        `progress(tag, save_dir, waited_s)` is called every PROGRESS_EVERY_S while it waits."""
        started = time.perf_counter()
        deadline = None if timeout_s is None else started + timeout_s
        self.pace.open_all()  # training waits: nothing of it is running (a step that raised left it closed)
        for checkpoint in self.pending():
            while not checkpoint.done.wait(_wait_slice(deadline)):
                waited = time.perf_counter() - started
                if deadline is not None and time.perf_counter() >= deadline:
                    raise CheckpointWaitTimeout(
                        f"lazyzero: checkpoint {checkpoint.tag!r} in {checkpoint.save_dir} was not committed within "
                        f"lazyzero.checkpoint.exit_timeout_s = {timeout_s:g} s; it is left uncommitted and the "
                        "newest committed checkpoint is the one to resume from")
                if progress is not None:
                    progress(checkpoint.tag, checkpoint.save_dir, waited)
        self.raise_failures()

    def pending(self) -> list[PendingCheckpoint]:
        """The checkpoints queued and not yet committed or failed, oldest first."""
        with self._lock:
            return list(self._pending)

    def raise_failures(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise CheckpointFailedError("lazyzero: " + "\n".join(errors))

    def close(self, timeout_s: float | None = None, progress=None) -> None:
        """Finish what is queued (within `timeout_s`), then stop and join every background thread;
        raises a failure of the last checkpoints. A second call does nothing. After a timeout the
        threads are left running (one may be inside a collective): the process must exit."""
        if self.closed:
            return
        try:
            self.wait(timeout_s, progress)
        except CheckpointWaitTimeout:
            raise
        except CheckpointFailedError:
            self._stop_threads()  # every checkpoint ended, one of them failed
            raise
        self._stop_threads()

    def _stop_threads(self) -> None:
        self.closed = True
        self._copy_queue.put(None)
        self._flush_queue.put(None)
        for thread in self._threads:
            thread.join()
        self._writers.shutdown(wait=True)
        self._staging.close()

    # --- DeepSpeed's CheckpointEngine interface --------------------------------------------------

    def create(self, info: CheckpointCommitInfo):
        if self._current is None:
            raise RuntimeError("LazyCheckpointEngine.create without prepare: "
                               "save through LazyZeroEngine.save_checkpoint")
        self._current.tag = check_tag(info.tag)
        temp_dir(self._current.save_dir, info.tag).mkdir(parents=True, exist_ok=True)

    def makedirs(self, path, exist_ok=False):
        # The tag folder appears only at commit, by renaming the temporary folder.
        if self._current is None or self._relative(path) is None:
            os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        relpath = self._relative(path)
        if relpath is None:
            raise ValueError(f"LazyCheckpointEngine.save: {path} is outside the checkpoint being saved "
                             f"({self._current.save_dir / self._current.tag})")
        self._current.files.append(snapshot_state(relpath, state_dict, self._current.slot))

    def commit(self, info: CheckpointCommitInfo):
        """Queue the checkpoint: copies start now, files are written and committed in the background."""
        checkpoint, self._current = self._current, None
        with self._lock:
            self._pending.append(checkpoint)
        checkpoint.timings["queued"] = time.perf_counter()
        checkpoint.background_cpu_start_s = self._background_clocks.seconds()
        self._start_copies(checkpoint)
        self._flush_queue.put(checkpoint)
        return True

    def load(self, path: str, map_location=None):
        return self.verified.load(path, map_location, self.config.allow_pickle)

    def is_decoupled(self):
        # DeepSpeed's decoupled path writes 'latest' itself, in place; the commit here does it by rename.
        return False

    def preserves_storage_sharing(self):
        # False stops DeepSpeed from cloning every tensor before `save`: the snapshot copies anyway.
        return False

    def cleanup(self):
        self.close()

    # --- background work -------------------------------------------------------------------------

    def _relative(self, path) -> str | None:
        if self._current is None or not self._current.tag:
            return None
        root = (self._current.save_dir / self._current.tag).resolve()
        target = Path(path).resolve()
        if target == root:
            return "."
        return target.relative_to(root).as_posix() if target.is_relative_to(root) else None

    def _take_slot(self) -> HostBuffers:
        """A buffer set; with `max_in_flight` checkpoints queued, wait for the oldest (or its failure)."""
        while True:
            try:
                return self._free_slots.get(timeout=0.05)
            except queue.Empty:
                self.raise_failures()

    def _start_copies(self, checkpoint: PendingCheckpoint) -> None:
        if self._side_stream is not None:
            start_device_copies(checkpoint.files, self._side_stream)
            checkpoint.cuda_copies = torch.cuda.Event()
            checkpoint.cuda_copies.record(self._side_stream)
        self._copy_queue.put(checkpoint)

    def _wait_copies(self, checkpoint: PendingCheckpoint) -> None:
        """Until every copy of `checkpoint` has landed in host memory (the flush reads them)."""
        checkpoint.copies_done.wait()
        if checkpoint.cuda_copies is not None:
            checkpoint.cuda_copies.synchronize()

    def _start_background_thread(self) -> None:
        """First thing in every background thread: count its CPU clock, and let training's threads
        preempt it (idle CPU and I/O classes; docs/checkpoint.md, "Scheduling")."""
        self._background_clocks.register_current()
        if self.config.background_priority == "idle":
            priority = lower_current_thread()
        else:
            priority = ThreadPriority(threading.get_native_id(), NORMAL, NORMAL,
                                      "lazyzero.checkpoint.background_priority: normal")
        with self._lock:
            self.thread_priorities[threading.current_thread().name] = priority

    def _copy_loop(self) -> None:
        self._start_background_thread()
        while (checkpoint := self._copy_queue.get()) is not None:
            try:
                check_free_space(temp_dir(checkpoint.save_dir, checkpoint.tag), bytes_to_write(checkpoint.files))
                run_copies(checkpoint.files, self.pace)
                live = [f for f in checkpoint.files if f.reads_live_state]
                if live:
                    if checkpoint.cuda_copies is not None:  # such a file may hold device tensors' buffers too
                        checkpoint.cuda_copies.synchronize()
                    checkpoint.write(live, self._writers, self._staging)
            except BaseException as err:  # noqa: BLE001 - reported through the checkpoint
                checkpoint.copy_error = err
            checkpoint.timings["copied"] = time.perf_counter()
            checkpoint.copies_done.set()

    def _flush_loop(self) -> None:
        self._start_background_thread()
        while (checkpoint := self._flush_queue.get()) is not None:
            error = None
            try:
                error = self._flush(checkpoint)
            except BaseException as err:  # noqa: BLE001 - a broken side group: report, keep the thread
                error = f"checkpoint {checkpoint.tag!r}: {type(err).__name__}: {err}"
            finally:
                self._finish(checkpoint, error)

    def _flush(self, checkpoint: PendingCheckpoint) -> str | None:
        """Write, agree, commit. Returns the error that stopped the commit (any rank's), or None."""
        self._wait_copies(checkpoint)
        failpoint("after_snapshot")
        status = {"rank": self.rank, "error": None, "files": {}}
        try:
            if checkpoint.copy_error is not None:
                raise checkpoint.copy_error
            checkpoint.write([f for f in checkpoint.files if not f.reads_live_state], self._writers, self._staging)
            status["files"] = make_durable(checkpoint.written, self.rank, self._writers)
            checkpoint.timings["written"] = time.perf_counter()
            failpoint("before_manifest")
        except BaseException as err:  # noqa: BLE001 - shared with every rank below
            discard_written(checkpoint.written)
            status["error"] = f"rank {self.rank}: {type(err).__name__}: {err}"
        statuses = self._all_gather(status)
        outcome = self._commit_if_all_written(checkpoint, statuses) if self.rank == 0 else None
        return self._broadcast(outcome)

    def _commit_if_all_written(self, checkpoint: PendingCheckpoint, statuses: list[dict]) -> str | None:
        errors = [s["error"] for s in statuses if s["error"]]
        if errors:
            discard_temp(checkpoint.save_dir, checkpoint.tag)
            return f"checkpoint {checkpoint.tag!r} was not committed: " + "; ".join(errors)
        files = {relpath: entry for s in statuses for relpath, entry in s["files"].items()}
        manifest = Manifest(checkpoint.tag, self.world_size, checkpoint.global_steps, files)
        try:
            deleted = commit_on_rank0(checkpoint.save_dir, manifest, checkpoint.save_latest, self.config.keep_last)
        except BaseException as err:  # noqa: BLE001 - shared with every rank by the broadcast
            renamed = (not temp_dir(checkpoint.save_dir, checkpoint.tag).exists()
                       and (checkpoint.save_dir / checkpoint.tag).is_dir())
            discard_temp(checkpoint.save_dir, checkpoint.tag)
            if not renamed:
                return f"checkpoint {checkpoint.tag!r} was not committed: rank 0: {type(err).__name__}: {err}"
            return (f"checkpoint {checkpoint.tag!r} is complete in {checkpoint.save_dir / checkpoint.tag} "
                    f"but 'latest' was not advanced to it: rank 0: {type(err).__name__}: {err}")
        if deleted:
            print(f"lazyzero: keep_last={self.config.keep_last}: deleted checkpoint(s) {', '.join(deleted)}",
                  flush=True)
        return None

    def _finish(self, checkpoint: PendingCheckpoint, error: str | None) -> None:
        marks = checkpoint.timings
        marks["committed"] = time.perf_counter()
        with self._lock:
            if error:
                self._errors.append(error)
            else:
                self.last_commit = {
                    "tag": checkpoint.tag, "bytes": sum(f.nbytes for f in checkpoint.files),
                    "direct_bytes": sum(f.live_nbytes for f in checkpoint.files),
                    # from the save: snapshot taken (the step may go on) / every file of this rank durable
                    "copy_s": marks["copied"] - marks["queued"],
                    "write_s": marks["written"] - marks["queued"],
                    "step_wait_s": checkpoint.step_wait_s, "slot_wait_s": checkpoint.slot_wait_s,
                    # CPU seconds of the copy, flush and writer threads from the save to the commit
                    # (with two checkpoints in flight, the older one's tail is counted here too)
                    "background_cpu_s": self._background_clocks.seconds() - checkpoint.background_cpu_start_s,
                    # host buffers and staging blocks held since, and what the planner predicts for them
                    "host_bytes": self._budget.used_bytes, "host_bytes_bound": self._host_bytes_bound(checkpoint),
                    "queued_to_committed_s": marks["committed"] - marks["queued"]}
            self._pending.remove(checkpoint)
        checkpoint.files, checkpoint.written = [], []  # drop references to live tensors and buffers
        self._free_slots.put(checkpoint.slot)
        checkpoint.done.set()

    def _host_bytes_bound(self, checkpoint: PendingCheckpoint) -> int:
        """The most host memory a snapshot of these files holds (snapshot_host_bytes, the formula the
        planner predicts it with)."""
        files = checkpoint.files
        return snapshot_host_bytes(sum(f.nbytes - f.live_nbytes for f in files), sum(f.nbytes for f in files),
                                   len(files), self._staging.block_bytes, self.config.host_buffer_limit,
                                   self.config.max_in_flight)

    def _all_gather(self, status: dict) -> list[dict]:
        if self._group is None:
            return [status]
        gathered = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, status, group=self._group)
        return gathered

    def _broadcast(self, outcome: str | None) -> str | None:
        if self._group is None:
            return outcome
        box = [outcome]
        torch.distributed.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


def _side_group(world_size: int, timeout: timedelta | None):
    """A gloo group of all ranks for the flush threads, so their agreement never interleaves with
    training collectives (NCCL or gloo) on the main thread. Created collectively at engine setup.
    `timeout` is the job's (`lazyzero.distributed.timeout_s`, its default when None): a peer that died
    or was stopped makes the agreement raise after it, and the checkpoint fails uncommitted
    (docs/reliability.md, guarantee 5)."""
    if world_size <= 1 or not torch.distributed.is_initialized():
        return None
    if timeout is None:
        timeout = timedelta(seconds=DistributedConfig().timeout_s)
    return torch.distributed.new_group(backend="gloo", timeout=timeout)


def _wait_slice(deadline: float | None) -> float:
    """How long one wait for a commit may block before progress is reported or the deadline checked."""
    if deadline is None:
        return PROGRESS_EVERY_S
    return max(0.0, min(PROGRESS_EVERY_S, deadline - time.perf_counter()))


def bytes_to_write(files: list[FileSnapshot]) -> int:
    """What one rank's files of a checkpoint take on disk, at most (their tensors, and each file's overhead)."""
    return sum(f.nbytes + FILE_OVERHEAD_BYTES for f in files)
