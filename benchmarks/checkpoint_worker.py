"""One engine's part of bench_checkpoint.py: ZeRO-3 training with a checkpoint every other block of
steps, raw timings to a JSON file (bench_checkpoint.py turns them into stalls and ratios).

Usage (under the deepspeed launcher, 2 ranks):
    checkpoint_worker.py --engine deepspeed|decoupled|lazyzero --model SPEC --save-dir DIR --out F.json
        [--warmup-steps N] [--cycles N] [--interval N] [--batch B] [--seq S] [--plain-write-repeats R]

After the warm-up steps, each cycle is
    save_checkpoint, `interval` steps (the block with a save) | `interval` steps (the block without)
so the blocks without a save are the reference, measured between the others, under the same load
(other processes, the page cache). Every clock starts and stops on the main thread around one
call; everything else (deleting DeepSpeed's older tags, flushing dirty pages, barriers, reading
lazyzero's commit figures) happens between blocks, outside every timed region (`settle`).

lazyzero only, at the end: `wait_for_checkpoints` (a failed checkpoint raises there or on the next
save or step, so reaching the end means every queued checkpoint was committed), the newest tag is
verified against its manifest; then, training paused, one more checkpoint is saved and waited for
(`paused_training_write`), and each rank writes as many bytes as one lazyzero checkpoint of its own
with a plain sequential writer (`plain_sequential_write`), both ranks at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import lazyzero
from lazyzero.checkpoint.manifest import committed_tags, verify_checkpoint
from lazyzero.models import build_model
from lazyzero.testing import destroy_engine, worker_args

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT / "ds_configs" / "cpu_demo.json"
# DeepSpeed 0.19.8 picks its engine from "checkpoint.writer" (runtime/checkpoint_engine/utils.py):
# none -> TorchCheckpointEngine (torch.save in save_checkpoint); decoupled -> DecoupledCheckpointEngine,
# which hands the state to a writer process and waits for it in the next step(). Its writer type
# "python" (PyFileWriter) is the one that runs on CPU torch ("fast" needs pinned memory).
ENGINE_SECTIONS = {
    "deepspeed": {},
    "decoupled": {"checkpoint": {"writer": {"type": "python", "decoupled": True}}},
    # lazyzero rejects DeepSpeed's "checkpoint.writer" in lazy mode: no writer section here.
    "lazyzero": {"lazyzero": {"checkpoint": {"enabled": True, "keep_last": 2}}},
}
PLAIN_WRITE_CHUNK = 64 * 2**20
SEED = 0


def parse_worker_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINE_SECTIONS, required=True)
    parser.add_argument("--model", required=True, help="a preset name or a config.json path (build_model)")
    parser.add_argument("--save-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=4, help="checkpoints saved (the first one included)")
    parser.add_argument("--interval", type=int, default=5, help="steps per block: a checkpoint every N steps")
    parser.add_argument("--batch", type=int, default=1, help="micro batch per rank")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--plain-write-repeats", type=int, default=3)
    return parser.parse_args(worker_args())


def engine_config(engine_name: str, batch: int) -> dict:
    """The CPU demo config (ZeRO-3, AdamW with torch_adam, fp32) with this engine's checkpoint section."""
    config = json.loads(BASE_CONFIG.read_text())
    config.pop("lazyzero", None)
    config["train_micro_batch_size_per_gpu"] = batch
    config.update(ENGINE_SECTIONS[engine_name])
    return config


def make_engine(args: argparse.Namespace):
    """(engine, parameter count): plain DeepSpeed for its two engines, lazyzero for ours."""
    model = build_model(args.model, seed=SEED)
    parameters = sum(p.numel() for p in model.parameters())
    config = engine_config(args.engine, args.batch)
    initialize = lazyzero.initialize if args.engine == "lazyzero" else deepspeed.initialize
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, parameters


def token_batches(vocab_size: int, batch: int, seq: int, count: int = 4) -> list[torch.Tensor]:
    """A few fixed synthetic batches per rank, cycled: the data does not change a step's cost."""
    generator = torch.Generator().manual_seed(SEED * 1000 + dist.get_rank())
    return [torch.randint(0, vocab_size, (batch, seq), generator=generator) for _ in range(count)]


class Trainer:
    """Timed steps and saves on one engine."""

    def __init__(self, engine, batches: list[torch.Tensor]):
        self.engine, self.batches, self.steps_done = engine, batches, 0

    def step(self) -> float:
        """Seconds of one forward, backward and optimizer step (a decoupled commit happens inside)."""
        ids = self.batches[self.steps_done % len(self.batches)]
        start = time.perf_counter()
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        seconds = time.perf_counter() - start
        self.steps_done += 1
        return seconds

    def steps(self, count: int) -> list[float]:
        return [self.step() for _ in range(count)]

    def save(self, save_dir: Path, tag: str) -> float:
        start = time.perf_counter()
        self.engine.save_checkpoint(str(save_dir), tag=tag)
        return time.perf_counter() - start


class CommitLog:
    """lazyzero's `last_commit` of every checkpoint seen committed, read between blocks."""

    def __init__(self, engine):
        self.engine = engine
        self.by_tag: dict[str, dict] = {}

    def note(self) -> str | None:
        """Record the newest commit; return its tag (None before the first)."""
        last = getattr(self.engine.checkpoint_engine, "last_commit", None)
        if last is not None:
            self.by_tag.setdefault(last["tag"], dict(last))
        return last["tag"] if last else None


def settle(save_dir: Path, keep_only: str | None) -> None:
    """Between blocks, outside timing: rank 0 deletes DeepSpeed's tags but `keep_only` (DeepSpeed
    keeps every tag; this bounds the disk use), then flushes every dirty page. DeepSpeed's engines
    do not fsync, so the kernel would write their checkpoint back during whichever block comes
    next, the reference blocks included; flushed here, each block starts clean. What the kernel
    writes back after a block with a save is therefore not charged to DeepSpeed (in its favour)."""
    dist.barrier()
    if dist.get_rank() == 0:
        if keep_only is not None:
            for folder in save_dir.iterdir():
                if folder.is_dir() and folder.name != keep_only:
                    shutil.rmtree(folder)
        os.sync()
    dist.barrier()


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def memory_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def run_cycles(args: argparse.Namespace, trainer: Trainer, commits: CommitLog | None) -> tuple[list[dict], float]:
    """Every (save + block, block without a save) cycle; the lowest MemAvailable seen (GB)."""
    cycles, lowest_memory = [], memory_available_gb()
    for index in range(args.cycles):
        tag = f"ckpt{index}"
        settle(args.save_dir, None)
        save_s = trainer.save(args.save_dir, tag)
        after_save = trainer.steps(args.interval)
        committed_in_block = commits.note() == tag if commits else None
        lowest_memory = min(lowest_memory, memory_available_gb())
        # On disk once committed: at once for DeepSpeed's default engine, in the first step after the
        # save for the decoupled one, when `last_commit` names it for lazyzero.
        on_disk = folder_bytes(args.save_dir / tag) if (args.save_dir / tag).is_dir() else None
        settle(args.save_dir, tag if args.engine != "lazyzero" else None)
        without_save = trainer.steps(args.interval)
        if commits:
            commits.note()
        cycles.append({"tag": tag, "save_s": save_s, "steps_after_save_s": after_save,
                       "steps_without_save_s": without_save, "committed_within_interval": committed_in_block,
                       "bytes_on_disk": on_disk})
        progress(f"{args.engine} {tag}: save {save_s:.3f} s, block with save {sum(after_save):.2f} s, "
                 f"without {sum(without_save):.2f} s")
    return cycles, lowest_memory


def finish_lazyzero(args: argparse.Namespace, engine, commits: CommitLog) -> dict:
    """Wait for every checkpoint (outside timing), verify the newest, and list what is on disk."""
    start = time.perf_counter()
    engine.wait_for_checkpoints()
    final_wait_s = time.perf_counter() - start
    newest = commits.note()
    dist.barrier()
    verified = None
    if dist.get_rank() == 0:
        verified = verify_checkpoint(args.save_dir / newest).tag
    return {"final_wait_s": final_wait_s, "newest_committed": newest, "newest_verified": verified,
            "tags_on_disk": committed_tags(args.save_dir), "commits": commits.by_tag}


def paused_training_write(args: argparse.Namespace, trainer: Trainer) -> dict:
    """`last_commit` of one more lazyzero checkpoint, saved and waited for with training paused:
    the writer's pace with the cores to itself, to compare with the plain write (also paused)."""
    dist.barrier()
    trainer.save(args.save_dir, "paused")
    trainer.engine.wait_for_checkpoints()
    return dict(trainer.engine.checkpoint_engine.last_commit)


def plain_sequential_write(folder: Path, nbytes: int, repeats: int) -> list[float]:
    """Seconds to write `nbytes` to a new file in `folder` the way a careful writer does: 64 MiB
    os.write calls from one ready buffer, fsync of the file, fsync of the folder; both ranks start
    together after a barrier. No serialization, no hashing: the disk's own pace."""
    chunk = torch.randint(0, 256, (PLAIN_WRITE_CHUNK,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(SEED)).numpy()
    view = memoryview(chunk).cast("B")
    path = folder / f"plain_write_rank{dist.get_rank()}.bin"
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        remaining = nbytes
        while remaining:
            remaining -= os.write(fd, view[: min(remaining, len(view))])
        os.fsync(fd)
        os.close(fd)
        folder_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(folder_fd)
        os.close(folder_fd)
        seconds.append(time.perf_counter() - start)
        dist.barrier()
        path.unlink()
    return seconds


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[checkpoint_worker] {message}", flush=True)


def main() -> None:
    args = parse_worker_args()
    engine, parameters = make_engine(args)
    trainer = Trainer(engine, token_batches(engine.module.config.vocab_size, args.batch, args.seq))
    progress(f"{args.engine}: {parameters / 1e6:.1f}M parameters, {args.warmup_steps} warm-up steps")
    warmup = trainer.steps(args.warmup_steps)
    commits = CommitLog(engine) if args.engine == "lazyzero" else None
    cycles, lowest_memory = run_cycles(args, trainer, commits)
    record = {"rank": dist.get_rank(), "engine": args.engine, "parameters": parameters,
              "warmup_steps_s": warmup, "cycles": cycles, "lowest_mem_available_gb": lowest_memory}
    if commits:
        record["lazyzero"] = finish_lazyzero(args, engine, commits)
        record["paused_write"] = paused_training_write(args, trainer)
        checkpoint_bytes = int(statistics.median(c["bytes"] for c in commits.by_tag.values()))
        record["plain_write"] = {"bytes": checkpoint_bytes, "seconds": plain_sequential_write(
            args.save_dir, checkpoint_bytes, args.plain_write_repeats)}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    destroy_engine(engine)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({"ranks": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
