"""docs/reliability.md rows 3 and 4: injected I/O errors and a failing writer thread during lazy saves.

One 2-rank launch (tests/checkpoint/lazy_ckpt_worker.py, mode errors) runs every case on one ZeRO-2
engine: per I/O case a clean save, then a save whose N-th write, fsync or rename on one rank (or
both) raises ENOSPC or EIO (LAZYZERO_IO_FAULT, N counted from the start of that save); then per
writer case a clean save and one whose client_state cannot be pickled, so torch.save raises in
rank 0's writer thread. Afterwards a fresh engine loads every committed tag and compares it with the
reference state of its step, bit for bit.

Per rank 0 checkpoint the I/O calls are, in order: the data files' writes and fsyncs (three files,
interleaved by the writer pool), fsync of the temporary folder, the manifest (write, fsync, rename,
fsync of the folder), the rename of the folder to its tag and fsync of save_dir, then 'latest'
(write, fsync, rename, fsync of save_dir): 9 fsyncs, 3 renames. Rank 1 writes two files and fsyncs
them and the folder. The cases below take each of those calls at least once.
"""

from __future__ import annotations

import errno
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from lazyzero.checkpoint import faults
from lazyzero.checkpoint.durable_io import write_file_atomically
from lazyzero.checkpoint.folder_layout import leftover_dirs
from lazyzero.checkpoint.manifest import verify_checkpoint
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "lazy_ckpt_worker.py"
# What an injected call touched, from its path.
DATA, TEMP_FOLDER, MANIFEST = "data", "temp folder", "manifest"
TAG_FOLDER, SAVE_DIR, LATEST = "tag folder", "save_dir", "latest"


@dataclass(frozen=True)
class IoCase:
    fault: str  # OP:N[:ERRNO][@RANK], N counted from the start of the save
    then: str  # "wait": wait_for_checkpoints at once; "train": the error comes where it comes
    touches: str  # what the N-th call of OP touches

    @property
    def errno_code(self) -> int:
        parts = self.fault.split("@")[0].split(":")
        return getattr(errno, parts[2]) if len(parts) > 2 else errno.ENOSPC

    @property
    def ranks(self) -> tuple[int, ...]:
        return (int(self.fault.split("@")[1]),) if "@" in self.fault else (0, 1)

    @property
    def after_rename(self) -> bool:
        """Failing once the tag folder is in place: the checkpoint stays listed, complete."""
        return self.touches in (SAVE_DIR, LATEST)


IO_CASES = [
    IoCase("write:1:ENOSPC@0", "wait", DATA),
    IoCase("write:2:EIO@0", "train", DATA),
    IoCase("write:3:ENOSPC@0", "train", DATA),
    IoCase("write:-2:EIO@0", "wait", MANIFEST),
    IoCase("write:-1:ENOSPC@0", "train", LATEST),
    IoCase("fsync:1:EIO@0", "wait", DATA),
    IoCase("fsync:2:ENOSPC@0", "train", DATA),
    IoCase("fsync:3:EIO@0", "wait", DATA),
    IoCase("fsync:4:ENOSPC@0", "train", TEMP_FOLDER),
    IoCase("fsync:5:EIO@0", "wait", MANIFEST),
    IoCase("fsync:6:ENOSPC@0", "train", TEMP_FOLDER),
    IoCase("fsync:7:EIO@0", "wait", SAVE_DIR),
    IoCase("fsync:8:ENOSPC@0", "train", LATEST),
    IoCase("fsync:9:EIO@0", "wait", SAVE_DIR),
    IoCase("rename:1:ENOSPC@0", "train", MANIFEST),
    IoCase("rename:2:EIO@0", "wait", TAG_FOLDER),
    IoCase("rename:3:ENOSPC@0", "wait", LATEST),
    IoCase("write:1:EIO@1", "wait", DATA),
    IoCase("write:2:ENOSPC@1", "train", DATA),
    IoCase("write:-1:EIO@1", "wait", DATA),
    IoCase("fsync:1:ENOSPC@1", "train", DATA),
    IoCase("fsync:2:EIO@1", "wait", DATA),
    IoCase("fsync:3:ENOSPC@1", "train", TEMP_FOLDER),
    IoCase("write:1:EIO", "wait", DATA),
    IoCase("fsync:1:ENOSPC", "train", DATA),
]


# One parameter per I/O case, named by its fault.
IO_CASE_PARAMS = [pytest.param(index, id=case.fault) for index, case in enumerate(IO_CASES)]


WRITER_CASES = ("step", "save", "wait")  # where the writer thread's failure is looked for


@dataclass
class Launch:
    out: Path  # io/ and writer/ are the two save_dirs
    records: list[dict]  # per rank


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    out = tmp_path_factory.mktemp("io_errors")
    faults_then = [f"{case.fault}/{case.then}" for case in IO_CASES]
    proc = run_distributed("deepspeed", 2, [str(WORKER), "errors", str(out), *faults_then], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return Launch(out, [json.loads((out / f"errors_rank{rank}.json").read_text()) for rank in (0, 1)])


def touched(path: str, save_dir: Path, tag: str) -> str:
    path, temporary = Path(path), save_dir / f".lazyzero-tmp.{tag}"
    if path.name in ("latest", ".latest.partial"):
        return LATEST
    if "lazyzero_manifest.json" in path.name:
        return MANIFEST
    if path.parent == temporary and path.suffix == ".pt":
        return DATA
    return {save_dir: SAVE_DIR, save_dir / tag: TAG_FOLDER, temporary: TEMP_FOLDER}.get(path, str(path))


def errors_naming(tag: str, errors: list[dict]) -> list[dict]:
    return [e for e in errors if f"checkpoint '{tag}'" in e["message"]]


@dataclass
class CaseOnRank:
    rank: int
    clean: str  # the tag saved just before
    faulty: str
    following: str  # the next tag saved after it
    errors: list[dict]  # those naming `faulty`
    hits: list[dict]  # the injected errors of this case on this rank
    record: dict  # the rank's whole record of the I/O phase


def case_on_ranks(launch: Launch, index: int) -> list[CaseOnRank]:
    views = []
    for rank, record in enumerate(launch.records):
        io = record["io"]
        tags = io["cases"][index]
        following = io["cases"][index + 1]["clean"] if index + 1 < len(IO_CASES) else io["final"]
        errors = errors_naming(tags["faulty"], io["errors"])
        hits = [h for h in io["hits"] if h["case"] == index]
        views.append(CaseOnRank(rank, tags["clean"], tags["faulty"], following, errors, hits, io))
    return views


@pytest.mark.multiproc
@pytest.mark.parametrize("index", IO_CASE_PARAMS)
def test_io_error_is_raised_once_on_every_rank_at_the_next_call(launch, index):
    case = IO_CASES[index]
    for view in case_on_ranks(launch, index):
        assert len(view.hits) == (view.rank in case.ranks), f"rank {view.rank}: {view.hits}"
        for hit in view.hits:
            assert touched(hit["path"], launch.out / "io", view.faulty) == case.touches, hit
        assert len(view.errors) == 1, f"rank {view.rank}: {view.errors}"
        assert view.errors[0]["call"] in (("wait",) if case.then == "wait" else ("step", "save", "wait"))
        assert errors_naming(view.clean, view.record["errors"]) == []


@pytest.mark.multiproc
@pytest.mark.parametrize("index", IO_CASE_PARAMS)
def test_io_error_message_names_the_injected_error(launch, index):
    for view in case_on_ranks(launch, index):
        [error] = view.errors
        assert "injected by LAZYZERO_IO_FAULT" in error["message"], f"rank {view.rank}: {error['message']}"
        assert os.strerror(IO_CASES[index].errno_code) in error["message"]


@pytest.mark.multiproc
@pytest.mark.parametrize("index", IO_CASE_PARAMS)
def test_failed_save_does_not_advance_latest(launch, index):
    for view in case_on_ranks(launch, index):
        [error] = view.errors
        # With "train" the next clean save may already be committed when the error is raised.
        allowed = (view.clean,) if IO_CASES[index].then == "wait" else (view.clean, view.following)
        assert error["latest"] in allowed, f"rank {view.rank}: {error}"


@pytest.mark.multiproc
@pytest.mark.parametrize("index", IO_CASE_PARAMS)
def test_failed_save_leaves_no_temporary_data(launch, index):
    for view in case_on_ranks(launch, index):
        [error] = view.errors
        if IO_CASES[index].then == "wait":  # nothing else in flight: nothing temporary at all
            assert error["temporary"] == [], f"rank {view.rank}"
        else:
            assert f".lazyzero-tmp.{view.faulty}" not in error["temporary"], f"rank {view.rank}"


@pytest.mark.multiproc
@pytest.mark.parametrize("index", IO_CASE_PARAMS)
def test_previous_checkpoint_stays_intact_and_loads_exactly(launch, index):
    views = case_on_ranks(launch, index)
    for view in views:
        load = view.record["loads"][view.clean]
        assert (load["tag"], load["differences"]) == (view.clean, []) and load["compared"] > 0, f"rank {view.rank}"
    save_dir = launch.out / "io"
    verify_checkpoint(save_dir / views[0].clean)
    if IO_CASES[index].after_rename:  # listed only because complete
        verify_checkpoint(save_dir / views[0].faulty)
    else:
        assert not (save_dir / views[0].faulty).exists()


@pytest.mark.multiproc
def test_run_goes_on_after_io_errors_without_leaking_descriptors(launch):
    faulty = [case["faulty"] for case in launch.records[0]["io"]["cases"]]
    for rank, record in enumerate(launch.records):
        io = record["io"]
        assert [e for e in io["errors"] if not any(errors_naming(tag, [e]) for tag in faulty)] == []
        assert io["descriptors_after"] == io["descriptors_before"], f"rank {rank}"
        assert io["latest"] == io["final"] and io["final"] in io["committed"]
        assert {tag: load["differences"] for tag, load in io["loads"].items()} == {tag: [] for tag in io["committed"]}
    assert leftover_dirs(launch.out / "io") == []


@pytest.mark.multiproc
@pytest.mark.parametrize("index", range(len(WRITER_CASES)), ids=WRITER_CASES)
def test_writer_thread_failure_reaches_the_training_loop_at_the_next_call(launch, index):
    save_dir = launch.out / "writer"
    for rank, record in enumerate(launch.records):
        case, loads = record["writer"]["cases"][index], record["writer"]["loads"]
        assert case["where"] == WRITER_CASES[index]
        [error] = case["errors"]
        assert error["call"] == case["where"], f"rank {rank}: {error}"
        assert f"checkpoint '{case['faulty']}' was not committed: rank 0:" in error["message"]
        assert "pickle" in error["message"]
        assert (error["latest"], error["temporary"]) == (case["clean"], []), f"rank {rank}"
        if case["where"] == "step":  # within one step: the first step after the failed save
            assert error["step"] == int(case["faulty"].removeprefix("step")) + 1
        if case["where"] == "save":  # saved again under the same tag, after the error was raised
            assert loads[case["faulty"]]["differences"] == [] and loads[case["faulty"]]["compared"] > 0
        else:
            assert not (save_dir / case["faulty"]).exists()
    writer = launch.records[0]["writer"]
    assert writer["latest"] == writer["final"]
    assert all(load["differences"] == [] for load in writer["loads"].values())
    assert leftover_dirs(save_dir) == []


@pytest.mark.parametrize("fault", [
    "write:1", "fsync:1", "write:1:EIO", "fsync:1:EIO",
    "rename:1",
])
def test_failed_atomic_write_keeps_the_old_file_and_leaves_no_partial_file(tmp_path, monkeypatch, fault):
    # faults.py counts calls per process; a fresh count makes N=1 this test's first call.
    monkeypatch.setattr(faults, "_io_calls", Counter())
    target = tmp_path / "latest"
    target.write_bytes(b"step2")
    monkeypatch.setenv("LAZYZERO_IO_FAULT", fault)
    with pytest.raises(OSError) as raised:
        write_file_atomically(target, b"step4")
    assert raised.value.errno == (errno.EIO if fault.endswith("EIO") else errno.ENOSPC)
    assert target.read_bytes() == b"step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
