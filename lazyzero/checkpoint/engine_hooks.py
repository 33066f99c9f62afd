"""What the checkpoint feature (feature.py) adds to DeepSpeed's save and load: the lazy engine,
lazyzero's per-rank state, NVMe-resident optimizer state, and verified loading (docs/checkpoint.md)."""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

import numpy as np
import torch
from deepspeed import comm as dist
from deepspeed.utils import logger

from lazyzero.checkpoint import job_end
from lazyzero.checkpoint.folder_layout import (
    MANIFEST_NAME,
    SymbolicLinkRefused,
    UnsafeCheckpointPath,
    check_tag,
    link_problem,
    read_latest,
)
from lazyzero.checkpoint.lazy_engine import LazyCheckpointEngine
from lazyzero.checkpoint.manifest import (
    CheckpointDamagedError,
    Manifest,
    committed_tags,
    damaged_latest,
    fell_back_warning,
    resolve_tag_to_load,
    verify_checkpoint,
)
from lazyzero.checkpoint.preemption import StopOnSigterm
from lazyzero.checkpoint.rank_state import load_rank_state, rank_state_document, rank_state_path
from lazyzero.checkpoint.verified_read import VerifiedFiles
from lazyzero.distributed.job_failure import collective_timeout
from lazyzero.feature import Feature
from lazyzero.patch_point import PatchRefused, replace_method


def lazy_checkpoint_engine(engine, verified: VerifiedFiles) -> LazyCheckpointEngine:
    """The engine's lazy checkpoint engine; the end of the job waits for its commits (job_end.py)."""
    checkpoint_engine = LazyCheckpointEngine(engine.lazyzero_config.checkpoint, rank=dist.get_rank(),
                                             world_size=dist.get_world_size(), on_cuda=engine.device.type == "cuda",
                                             verified=verified, timeout=collective_timeout(engine.lazyzero_config))
    job_end.register(checkpoint_engine)
    return checkpoint_engine


def pause_background_during_gathers(engine, pace) -> list:
    """Under ZeRO-3, close `pace`'s window while a forward pass gathers a module's parameters: DeepSpeed
    gathers them in a forward pre-hook it registers on every module when the engine is built, so a
    pre-hook put before it and one put after it bracket the gather (docs/checkpoint.md, "Scheduling").
    The hooks' handles, for `remove_hooks`."""
    if engine.zero_optimization_stage() != 3:
        return []
    handles = []
    for module in engine.module.modules():
        if next(module.parameters(recurse=False), None) is None:
            continue  # DeepSpeed gathers nothing for a module that holds no parameter itself
        handles.append(module.register_forward_pre_hook(lambda *_: pace.close("gather"), prepend=True))
        handles.append(module.register_forward_pre_hook(lambda *_: pace.open("gather")))
    return handles


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def stop_on_sigterm(engine) -> StopOnSigterm:
    """The SIGTERM handler and agreement of a lazy-checkpoint engine (preemption.py); collective."""
    return StopOnSigterm(dist.get_rank(), dist.get_world_size(), engine.lazyzero_config.checkpoint.save_on_sigterm,
                         collective_timeout(engine.lazyzero_config))


def route_deepspeed_loads(engine, verified: VerifiedFiles) -> None:
    """DeepSpeed's own checkpoint engine (lazy checkpoints off) loads through `verified`: no code runs,
    and a verified tag's files load from the bytes that were hashed."""
    checkpoint_engine = engine.checkpoint_engine
    allow_pickle = engine.lazyzero_config.checkpoint.allow_pickle

    def load(path, map_location=None):
        return verified.load(path, map_location, allow_pickle)

    try:
        replace_method(checkpoint_engine, "load", load, owner="checkpoint")
    except PatchRefused:
        logger.warning(f"lazyzero: {type(checkpoint_engine).__name__} loads checkpoint files itself: they are "
                       "verified against their manifest first, but loaded as DeepSpeed loads them")


@contextlib.contextmanager
def lazy_save(engine, feature, save_dir: str, save_latest: bool):
    """Around DeepSpeed's save_checkpoint: take a buffer slot before, release it if the save fails.
    `feature.inside_lazy_save` is set meanwhile (DeepSpeed must not copy the NVMe swap folder)."""
    checkpoint_engine = engine.checkpoint_engine
    checkpoint_engine.prepare(str(save_dir), save_latest, engine.global_steps, barrier=dist.barrier)
    feature.inside_lazy_save = True
    try:
        yield
    except BaseException:
        checkpoint_engine.abandon()
        raise
    finally:
        feature.inside_lazy_save = False


def save_rank_state(engine, save_dir: str, tag: str) -> None:
    """lazyzero_rank<R>.pt through the engine's checkpoint engine, inside DeepSpeed's save (so before
    'latest' is written, and in the same lazy commit)."""
    if not engine.lazyzero_features.any(Feature.keeps_rank_state, engine):
        return
    document = rank_state_document(engine.global_rank, engine.world_size, engine.lazyzero_rank_state())
    engine.checkpoint_engine.save(document, str(rank_state_path(os.path.join(save_dir, tag), engine.global_rank)))


def snapshot_nvme_optimizer_files(engine, save_dir: str, tag: str) -> None:
    """The optimizer's NVMe swap files, as DeepSpeed itself would copy them (same folder in the
    checkpoint, gradient swap files skipped), but read into host buffers before the next step."""
    if not engine.zero_optimization() or not getattr(engine.optimizer, "optimizer_swapper", None):
        return
    from deepspeed.runtime.engine import dp_index_to_str

    rank = engine.local_rank if engine.use_node_local_storage() else engine.global_rank
    swap_folder = Path(engine.optimizer.optimizer_swapper.swap_folder)
    for source in sorted(p for p in swap_folder.rglob("*") if p.is_file()):
        relative = source.relative_to(swap_folder)
        if any("gradient" in part for part in relative.parts):
            continue
        engine.checkpoint_engine.add_raw_file(
            f"offloaded_tensors/rank{dp_index_to_str(rank)}/{relative.as_posix()}", str(source))


def prepare_load(engine, lazy: bool, load_dir: str, tag: str | None, verified: VerifiedFiles) -> str | None:
    """The tag to load, after cleaning leftovers and verifying it (CheckpointDamagedError if damaged,
    UnsafeCheckpointPath if the tag or 'latest' leads outside `load_dir` or is a symbolic link);
    `verified` then holds its folder and the hashes its files must load with."""
    settings = engine.lazyzero_config.checkpoint
    from_latest = tag is None
    if lazy:
        engine.checkpoint_engine.clean_leftovers(load_dir, barrier=dist.barrier)
        if tag is None:
            tag, why = resolve_tag_to_load(load_dir, settings.on_damaged_latest)
            _warn(engine, why)
            if tag is None:
                return None
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None  # no 'latest': nothing to load, as with DeepSpeed
    tag = check_tag(str(tag))
    tag_dir = Path(load_dir) / tag
    link = link_problem(tag_dir)  # never followed; from 'latest' it is a damaged latest (below)
    if link and not from_latest:
        raise SymbolicLinkRefused(link)
    has_manifest = not link and os.path.lexists(tag_dir / MANIFEST_NAME)
    if lazy and not link and tag_dir.is_dir() and not has_manifest and not settings.allow_unverified:
        raise CheckpointDamagedError(
            f"{tag_dir}: no {MANIFEST_NAME}, so nothing can verify its files (a plain DeepSpeed checkpoint, or one "
            "lazyzero never committed). To load it anyway, set lazyzero.checkpoint.allow_unverified: true")
    manifest = None
    if link or (has_manifest and settings.verify_on_load):
        tag, manifest = _verify_or_fall_back(engine, load_dir, tag, from_latest)
    verified.expect(Path(load_dir) / tag, manifest)
    return tag


def _verify_or_fall_back(engine, load_dir: str, tag: str, from_latest: bool) -> tuple[str, Manifest]:
    """`tag` and its manifest once its files match. A damaged tag is an error, unless it is the one a
    resume picked by itself and `on_damaged_latest` is fall_back: then the newest older committed
    tag that verifies loads, with a warning naming what is damaged."""
    try:
        return tag, verify_checkpoint(Path(load_dir) / tag)
    except (CheckpointDamagedError, UnsafeCheckpointPath) as err:
        if not from_latest:
            raise
        problems = [str(err)]
    others = [other for other in committed_tags(load_dir) if other != tag]
    damaged_latest(load_dir, tag, problems[0], others, engine.lazyzero_config.checkpoint.on_damaged_latest)
    for older in reversed(others):
        try:
            manifest = verify_checkpoint(Path(load_dir) / older)
        except (CheckpointDamagedError, UnsafeCheckpointPath) as err:
            problems.append(str(err))
            continue
        _warn(engine, fell_back_warning(load_dir, tag, "\n".join(problems), older))
        return older, manifest
    raise CheckpointDamagedError(f"{load_dir}: the newest checkpoint, {tag!r}, is damaged, and so is every older "
                                 "committed one:\n" + "\n".join(problems))


def _warn(engine, why: str) -> None:
    if why and engine.global_rank == 0:
        print(f"lazyzero: {why}", flush=True)


def restore_rank_state(engine, tag_dir: str, verified: VerifiedFiles) -> None:
    """lazyzero_rank<R>.pt, read as every checkpoint file is: through `verified` (the tag's folder,
    no link followed, its hash checked) and without running code."""
    features = engine.lazyzero_features
    if not features.any(Feature.keeps_rank_state, engine):
        return
    allow_pickle = engine.lazyzero_config.checkpoint.allow_pickle
    state, why_not = load_rank_state(tag_dir, engine.global_rank, engine.world_size,
                                     load=lambda path: verified.load(path, "cpu", allow_pickle))
    if state is None:
        logger.warning(f"lazyzero: {why_not}; int8 error-feedback residuals restart from zero, RNG states are kept")
        return
    features.call(Feature.load_rank_state, engine, state)


def rng_state() -> dict:
    """Every generator a training loop draws from: torch's (CPU and CUDA), numpy's global one and
    Python's `random`, which data pipelines and augmentations use (docs/reliability.md, guarantee 3).
    numpy's and Python's states are kept as tensors and numbers, which load with weights_only."""
    numpy_state = np.random.get_state(legacy=False)
    version, python_state, gauss_next = random.getstate()
    state = {"cpu": torch.get_rng_state(),
             "numpy": {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                       "pos": numpy_state["state"]["pos"], "has_gauss": numpy_state["has_gauss"],
                       "gauss": numpy_state["gauss"]},
             "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64),
                        "gauss_next": gauss_next}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:  # absent from checkpoints written before numpy's and Python's states were kept
        saved = state["numpy"]
        np.random.set_state({"bit_generator": "MT19937",
                             "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]},
                             "has_gauss": saved["has_gauss"], "gauss": saved["gauss"]})
    if "python" in state:
        saved = state["python"]
        random.setstate((saved["version"], tuple(saved["state"].tolist()), saved["gauss_next"]))
