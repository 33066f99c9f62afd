"""One engine's part of bench_checkpoint.py: ZeRO-3 training, blocks of steps with a checkpoint in
flight and without, in ABBA order, in two scenarios; raw timings to a JSON file.

Usage (under the deepspeed launcher, 2 ranks):
    checkpoint_worker.py --engine deepspeed|decoupled|lazyzero|dcp_async --model SPEC --save-dir DIR --out F.json
        [--pairs N] [--interval N] [--batch B] [--seq S] [--idle-seq S] [--plain-write-repeats R]

Scenarios (benchmarks/README.md, "bench_checkpoint"):
- `busy_cores`: every step is a real forward, backward and optimizer step on the batch; the ranks'
  threads keep every core busy (a CPU-only run).
- `idle_cores`: the host a GPU run has. The forward and backward the accelerator computes are a
  sleep of their measured time (the real batch's, median of the warm-up steps of the run's first
  launch, given to the others by `--accelerator-s`), during which the host's cores are idle; the
  engine still runs a real forward and backward of a short batch and its real optimizer step on
  the host, so the state changes every step and every engine path runs. On this CPU-only machine
  that host share (ZeRO-3's gathers and reductions, the optimizer) is most of a real step, so the
  cores are idle for about half of each step: a host busier than a GPU run's.
A block is `interval` steps; a block "with" starts with save_checkpoint and, for lazyzero, ends
with wait_for_checkpoints (timed: whatever the checkpoint has left to do is charged to it). Pairs
alternate (with, without), (without, with), ... so that a drift of the step time cancels. Before
every block, outside timing, rank 0 removes DeepSpeed's older tags and every dirty page is flushed
(`settle`). One block with a checkpoint before the pairs is reported on its own: lazyzero
allocates its buffers and touches their pages then.

lazyzero only, at the end: the newest tag is verified against its manifest; then, training paused,
one more checkpoint is saved and waited for (`paused_training_write`), and each rank writes as many
bytes as one checkpoint of its own with a plain sequential writer (`plain_sequential_write`).
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
    # Plain DeepSpeed's engine, its state saved by PyTorch's torch.distributed.checkpoint.async_save
    # (DcpAsyncSaver below) instead of save_checkpoint.
    "dcp_async": {},
}
SCENARIOS = ("busy_cores", "idle_cores")
PLAIN_WRITE_CHUNK = 64 * 2**20
SEED = 0
COMPUTE_SAMPLES = 3  # warm-up steps whose forward and backward are timed, per batch length


def parse_worker_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINE_SECTIONS, required=True)
    parser.add_argument("--model", required=True, help="a preset name or a config.json path (build_model)")
    parser.add_argument("--save-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=4, help="(with, without) pairs per scenario")
    parser.add_argument("--interval", type=int, default=3, help="steps per block")
    parser.add_argument("--batch", type=int, default=1, help="micro batch per rank")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--idle-seq", type=int, default=4, help="tokens per sequence the host computes (idle_cores)")
    parser.add_argument("--plain-write-repeats", type=int, default=3)
    parser.add_argument("--accelerator-s", type=float,
                        help="the idle_cores sleep per step, measured by an earlier launch (default: measure it)")
    parser.add_argument("--copy-bandwidth-share", type=float,
                        help="lazyzero: lazyzero.checkpoint.copy_bandwidth_share (default: the config's default)")
    return parser.parse_args(worker_args())


def engine_config(engine_name: str, batch: int, copy_bandwidth_share: float | None = None) -> dict:
    """The CPU demo config (ZeRO-3, AdamW with torch_adam, fp32) with this engine's checkpoint section."""
    config = json.loads(BASE_CONFIG.read_text())
    config.pop("lazyzero", None)
    config["train_micro_batch_size_per_gpu"] = batch
    config.update(json.loads(json.dumps(ENGINE_SECTIONS[engine_name])))
    if copy_bandwidth_share is not None and engine_name == "lazyzero":
        config["lazyzero"]["checkpoint"]["copy_bandwidth_share"] = copy_bandwidth_share
    return config


def make_engine(args: argparse.Namespace):
    """(engine, parameter count): plain DeepSpeed for its two engines, lazyzero for ours."""
    model = build_model(args.model, seed=SEED)
    parameters = sum(p.numel() for p in model.parameters())
    config = engine_config(args.engine, args.batch, args.copy_bandwidth_share)
    initialize = lazyzero.initialize if args.engine == "lazyzero" else deepspeed.initialize
    engine, _, _, _ = initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, parameters


def token_batches(vocab_size: int, batch: int, seq: int, count: int = 4) -> list[torch.Tensor]:
    """A few fixed synthetic batches per rank, cycled: the data does not change a step's cost."""
    generator = torch.Generator().manual_seed(SEED * 1000 + seq * 10 + dist.get_rank())
    return [torch.randint(0, vocab_size, (batch, seq), generator=generator) for _ in range(count)]


class EngineSaver:
    """DeepSpeed's save_checkpoint (DeepSpeed's engines and lazyzero's); the block's end waits for
    lazyzero's commit (DeepSpeed's decoupled writer is waited for inside the next step)."""

    def __init__(self, engine):
        self.engine = engine

    def save(self, save_dir: Path, tag: str) -> None:
        self.engine.save_checkpoint(str(save_dir), tag=tag)

    def wait(self) -> None:
        if hasattr(self.engine, "wait_for_checkpoints"):
            self.engine.wait_for_checkpoints()


class DcpAsyncSaver:
    """The same engine's state saved with `torch.distributed.checkpoint.async_save`, as a DeepSpeed
    user who picks PyTorch's asynchronous checkpoint would: what lazyzero and DeepSpeed's ZeRO-3
    checkpoints hold per rank (the fp32 master partition and AdamW's moments: the optimizer's
    state_dict), under per-rank keys, since DCP writes a plain tensor found under the same key on
    every rank once, as replicated. async_save copies the state to CPU memory in the call (its default
    stager), then plans and writes in a thread, on a gloo group of its own as DCP's documentation
    asks (training's collectives run on the default group meanwhile). The block's end waits for
    the write, as it waits for lazyzero's commit."""

    def __init__(self, engine):
        import torch.distributed.checkpoint as dcp

        self.engine, self.dcp, self.pending = engine, dcp, None
        self.group = dist.new_group(backend="gloo")

    def state(self) -> dict:
        return {f"rank{dist.get_rank()}": self.engine.optimizer.state_dict()}

    def save(self, save_dir: Path, tag: str) -> None:
        self.pending = self.dcp.async_save(self.state(), checkpoint_id=str(save_dir / tag), process_group=self.group)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def make_saver(engine_name: str, engine):
    return DcpAsyncSaver(engine) if engine_name == "dcp_async" else EngineSaver(engine)


class Trainer:
    """Timed steps and saves on one engine."""

    def __init__(self, engine, batches: list[torch.Tensor], short_batches: list[torch.Tensor], saver):
        self.engine, self.batches, self.short_batches, self.saver = engine, batches, short_batches, saver
        self.steps_done, self.accelerator_s = 0, 0.0

    def step(self, scenario: str) -> float:
        """Seconds of one forward, backward and optimizer step (a decoupled commit happens inside)."""
        start = time.perf_counter()
        self.forward_backward(short=scenario == "idle_cores")
        self.engine.step()
        self.steps_done += 1
        return time.perf_counter() - start

    def forward_backward(self, short: bool) -> float:
        batches = self.short_batches if short else self.batches
        ids = batches[self.steps_done % len(batches)].to(self.engine.device)
        start = time.perf_counter()
        loss = self.engine(input_ids=ids, labels=ids).loss
        if short:
            time.sleep(self.accelerator_s)  # the accelerator's forward and backward; host cores idle
        self.engine.backward(loss)
        return time.perf_counter() - start

    def measure_accelerator_time(self, given_s: float | None) -> dict:
        """Warm-up: the median time of forward and backward on the real batch, what the accelerator
        computes in the idle_cores scenario. `given_s`, the first engine's measurement, is used when
        given: every engine of a run sleeps the same."""
        seconds = []
        for _ in range(COMPUTE_SAMPLES):
            seconds.append(self.forward_backward(short=False))
            self.engine.step()
            self.steps_done += 1
        # Every rank sleeps the same time: the slowest rank's, as a collective step would.
        measured = torch.tensor([statistics.median(seconds)], device=self.engine.device)  # NCCL's on a GPU
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        self.accelerator_s = float(measured) if given_s is None else given_s
        return {"forward_backward_s": seconds, "measured_accelerator_s": float(measured),
                "accelerator_s": self.accelerator_s}

    def block(self, scenario: str, steps: int, save_dir: Path | None = None, tag: str | None = None) -> dict:
        """One block of `steps` steps; with `save_dir`, a checkpoint first (and, for lazyzero and DCP,
        its commit awaited at the end, inside the block's time)."""
        cpu_start, start = time.process_time(), time.perf_counter()
        save_s = save_cpu_s = wait_s = 0.0
        if save_dir is not None:
            self.saver.save(save_dir, tag)
            save_s, save_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        step_s = [self.step(scenario) for _ in range(steps)]
        if save_dir is not None:
            waited = time.perf_counter()
            self.saver.wait()
            wait_s = time.perf_counter() - waited
        return {"block_s": time.perf_counter() - start, "save_s": save_s, "save_main_cpu_s": save_cpu_s,
                "steps_s": step_s, "final_wait_s": wait_s}


def settle(save_dir: Path, keep_only: str | None) -> None:
    """Between blocks, outside timing: rank 0 deletes DeepSpeed's tags but `keep_only` (DeepSpeed
    keeps every tag; this bounds the disk use), then flushes every dirty page. DeepSpeed's engines
    do not fsync, so the kernel would write their checkpoint back during whichever block comes
    next; flushed here, each block starts clean, and that writeback is not charged to DeepSpeed."""
    dist.barrier()
    if dist.get_rank() == 0:
        if keep_only is not None and save_dir.is_dir():
            for folder in save_dir.iterdir():
                if folder.is_dir() and folder.name != keep_only:
                    shutil.rmtree(folder)
        os.sync()
    dist.barrier()


def memory_available_gb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


class BlockRunner:
    """Numbered checkpoints, settled blocks, lazyzero's commit figures attached to each save block."""

    def __init__(self, args: argparse.Namespace, trainer: Trainer):
        self.args, self.trainer, self.saved, self.lowest_memory = args, trainer, 0, memory_available_gb()

    def with_save(self, scenario: str) -> dict:
        tag = f"ckpt{self.saved}"
        self.saved += 1
        settle(self.args.save_dir, None)
        block = self.trainer.block(scenario, self.args.interval, self.args.save_dir, tag)
        self.lowest_memory = min(self.lowest_memory, memory_available_gb())
        last = getattr(self.trainer.engine.checkpoint_engine, "last_commit", None)
        if self.args.engine == "lazyzero":
            if last is None or last["tag"] != tag:
                raise RuntimeError(f"lazyzero: {tag} was not committed by wait_for_checkpoints")
            block["commit"] = dict(last)
        block["tag"] = tag
        settle(self.args.save_dir, tag if self.args.engine != "lazyzero" else None)
        return block

    def without_save(self, scenario: str) -> dict:
        settle(self.args.save_dir, None)
        return self.trainer.block(scenario, self.args.interval)

    def pairs(self, scenario: str) -> list[dict]:
        """(with, without), (without, with), ...: each pair's two blocks, labelled."""
        result = []
        for index in range(self.args.pairs):
            order = ("with", "without") if index % 2 == 0 else ("without", "with")
            pair = {kind: self.with_save(scenario) if kind == "with" else self.without_save(scenario) for kind in order}
            result.append(pair)
            progress(f"{self.args.engine} {scenario} pair {index + 1}/{self.args.pairs}: "
                     f"with {pair['with']['block_s']:.2f} s (save {pair['with']['save_s']:.3f} s), "
                     f"without {pair['without']['block_s']:.2f} s")
        return result


def finish_lazyzero(args: argparse.Namespace, engine) -> dict:
    """Verify the newest checkpoint and list what is on disk (outside timing)."""
    engine.wait_for_checkpoints()
    newest = engine.checkpoint_engine.last_commit["tag"]
    dist.barrier()
    verified = verify_checkpoint(args.save_dir / newest).tag if dist.get_rank() == 0 else None
    return {"newest_committed": newest, "newest_verified": verified, "tags_on_disk": committed_tags(args.save_dir)}


def paused_training_write(args: argparse.Namespace, engine) -> dict:
    """`last_commit` of one more lazyzero checkpoint, saved and waited for with training paused:
    the writer's pace with the cores to itself, to compare with the plain write (also paused)."""
    dist.barrier()
    engine.save_checkpoint(str(args.save_dir), tag="paused")
    engine.wait_for_checkpoints()
    return dict(engine.checkpoint_engine.last_commit)


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


def folder_bytes(folder: Path) -> int:
    """Bytes of every file in a checkpoint folder, all ranks' (what the engine wrote, to compare)."""
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[checkpoint_worker] {message}", flush=True)


def main() -> None:
    args = parse_worker_args()
    engine, parameters = make_engine(args)
    vocab = engine.module.config.vocab_size
    trainer = Trainer(engine, token_batches(vocab, args.batch, args.seq),
                      token_batches(vocab, args.batch, args.idle_seq), make_saver(args.engine, engine))
    progress(f"{args.engine}: {parameters / 1e6:.1f}M parameters, warming up")
    warmup = {"first_step_s": trainer.step("busy_cores"), **trainer.measure_accelerator_time(args.accelerator_s)}
    runner = BlockRunner(args, trainer)
    warmup["first_checkpoint_block"] = runner.with_save("busy_cores")
    progress(f"{args.engine}: accelerator time per step {trainer.accelerator_s:.2f} s; "
             f"first checkpoint block {warmup['first_checkpoint_block']['block_s']:.2f} s")
    record = {"rank": dist.get_rank(), "engine": args.engine, "parameters": parameters, "warmup": warmup,
              "scenarios": {scenario: runner.pairs(scenario) for scenario in SCENARIOS}}
    record["lowest_mem_available_gb"] = runner.lowest_memory
    if args.engine == "lazyzero":
        record["lazyzero"] = finish_lazyzero(args, engine)
        record["paused_write"] = paused_training_write(args, engine)
        checkpoint_bytes = record["paused_write"]["bytes"]
        record["plain_write"] = {"bytes": checkpoint_bytes, "seconds": plain_sequential_write(
            args.save_dir, checkpoint_bytes, args.plain_write_repeats)}
    else:
        record["last_checkpoint_bytes_on_disk"] = folder_bytes(args.save_dir / f"ckpt{runner.saved - 1}")
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    destroy_engine(engine)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps({"ranks": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
