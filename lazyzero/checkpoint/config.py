"""The `lazyzero.checkpoint` config section and its checks against DeepSpeed's "checkpoint" settings.

A capability's section module is on the foundation layer (docs/architecture.md, "The layering rule"):
it imports only `lazyzero.config` helpers, so that `lazyzero.config` composes it into `LazyZeroConfig`.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from lazyzero.config.errors import Problem
from lazyzero.config.fieldtypes import MemorySizeAtLeast
from lazyzero.config.section import ConfigSection

# The checkpoint writer's staging block (lazyzero/checkpoint/staged_io.py): the least snapshot memory.
STAGING_BLOCK_BYTES = 8 << 20


class CheckpointConfig(ConfigSection):
    """Lazy asynchronous checkpoints: snapshot to host memory, write and commit in the background."""

    retired_keys = {"mode": "use lazyzero.checkpoint.enabled: true for lazy checkpoints (false: DeepSpeed's own)"}

    enabled: bool = False
    """Lazy checkpoints: save returns once the snapshot is taken; false keeps DeepSpeed's checkpoint engine."""

    keep_last: Optional[int] = Field(None, ge=1)
    """Keep the newest N committed checkpoints and delete older ones. null: keep all."""

    host_buffer_limit: Optional[MemorySizeAtLeast(STAGING_BLOCK_BYTES, "one 8 MiB staging block")] = None
    """Host memory for the snapshot: buffers of device tensors, views and NVMe swap files, and the staging blocks
    files are written through (at least one 8 MiB block; at the limit they wait for the disk). null: as much as one
    snapshot needs."""

    max_in_flight: int = Field(1, ge=1)
    """Snapshots that may be queued or being written at once; a further save waits."""

    writer_threads: int = Field(2, ge=1, le=64)
    """Threads writing checkpoint files in the background."""

    background_priority: Literal["idle", "normal"] = "idle"
    """The priority of the background threads (snapshot copy, writers, flush and commit): "idle" puts each in Linux's
    idle CPU scheduling class (SCHED_IDLE) and idle I/O priority class, so that training's threads always preempt
    them; where the platform refuses, they run at normal priority (`lazyzero env` says why). "normal": training's
    priority."""

    copy_bandwidth_share: Optional[float] = Field(None, gt=0, le=1)
    """The most of this machine's memory copy bandwidth (measured once per process) the snapshot copies and the
    writers' staging copies may take, so that a step overlapping them keeps the rest; they also pause while training
    runs its optimizer step and ZeRO-3's forward gathers (docs/checkpoint.md, "Scheduling"). null: no rate limit."""

    verify_on_load: bool = True
    """Check every file's size and hash against the manifest before loading (docs/reliability.md, guarantee 2)."""

    allow_unverified: bool = False
    """With lazy checkpoints: load a tag that has no manifest (a plain DeepSpeed checkpoint, or a folder lazyzero
    never committed), whose files nothing can verify. Off, such a tag is refused with an error naming it."""

    allow_pickle: bool = False
    """Load checkpoint files that hold types other than tensors, containers, numbers and DeepSpeed's few
    (lazyzero/safe_load.py). Loading such a file runs code it names: only for folders you trust."""

    exit_timeout_s: float = Field(1800.0, ge=1)
    """Seconds the end of a job (the Trainer's train() returning, engine.destroy(), the world process group destroyed,
    the interpreter's exit, a SIGTERM stop) waits for queued checkpoints to commit, saying every 10 s what it waits
    for; past it the checkpoint is reported uncommitted and the process exits with status 1."""

    save_on_sigterm: bool = False
    """On SIGTERM (a cluster's preemption) every rank stops at the next optimizer step all of them reach, commits
    the checkpoints in flight and exits with status 143; true also saves one more checkpoint at that step first (the
    Trainer's next checkpoint-N folder, or DeepSpeed's default tag in the folder of the engine's last save)."""

    on_damaged_latest: Literal["stop", "fall_back"] = "stop"
    """When the checkpoint a resume picks by itself (the tag 'latest' names) is damaged (a file or its manifest
    differs, or is a symbolic link): "stop" refuses to load, naming what is damaged; "fall_back" loads the newest
    older committed checkpoint that verifies, with a warning naming the damage (docs/reliability.md, guarantee 2).
    A tag given by name is never replaced."""


def checkpoint_problems(checkpoint: CheckpointConfig, ds_config: dict) -> list[Problem]:
    """DeepSpeed checkpoint settings that lazy checkpoints would silently override."""
    ds_checkpoint = ds_config.get("checkpoint")
    if not checkpoint.enabled or not isinstance(ds_checkpoint, dict):
        return []
    problems = []
    if ds_checkpoint.get("writer") is not None:
        problems.append(Problem.conflict(
            "checkpoint.writer", ds_checkpoint["writer"], "absent while lazyzero.checkpoint.enabled is true",
            "lazyzero installs its own checkpoint engine, so DeepSpeed's writer settings would be ignored"))
    if ds_checkpoint.get("use_node_local_storage") is True:
        problems.append(Problem.conflict(
            "checkpoint.use_node_local_storage", True, "false while lazyzero.checkpoint.enabled is true",
            "rank 0 commits a checkpoint by renaming one folder holding every rank's files, "
            "so save_dir must be one shared filesystem"))
    return problems
