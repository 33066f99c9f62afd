"""Lazy checkpoints under faults, on 2 real ranks (docs/reliability.md rows 1, 3, 4, 5; tests/checkpoint/).

A small MLP (fixed seed, data drawn from the step number and the rank) trains with ZeRO-1/2/3 and
`"lazyzero": {"checkpoint": {"enabled": true}}`; tag `step<n>` is saved after step n with
client_state {"step": n}. The reference of a saved step is this rank's state at that step, taken
synchronously just before the save (`state_of`): parameters (ZeRO-3: this rank's partition), the
optimizer's state_dict (fp32 master partition, Adam moments, hyperparameters), the LR scheduler,
the step count and the RNG. Loaded or saved states must equal it bit for bit.

Usage (under the deepspeed launcher, 2 ranks); each mode writes OUT/<mode>_rank<r>.json:
  train OUT SAVE_DIR STAGE STEPS SAVE_EVERY
      train, saving every SAVE_EVERY steps; references go to OUT/ref/rank<r>/step<n>.pt before each
      save starts, since a failpoint may SIGKILL the rank from the flush thread at any moment after.
  load OUT STAGE:SAVE_DIR:REF_DIR ...
      per checkpoint folder, a fresh engine resumes from SAVE_DIR (no tag: 'latest' or the fallback)
      and compares its state with the reference of the step it loaded.
  errors OUT FAULT ...
      I/O faults (OUT/io), then writer-thread failures (OUT/writer), then every committed tag is
      loaded by a fresh engine and compared. FAULT is OP:N[:ERRNO][@RANK]/THEN: one clean save, then
      a save whose N-th OP call on RANK (both ranks without @) raises OSError(ERRNO); N < 0 counts
      from the end of a checkpoint. THEN is "wait" (wait at once) or "train" (go on training; the
      error comes at a step, a save or the wait before the next fault).
  slow_writer OUT SEED:MAX_IN_FLIGHT:STAGE ...
      per run, every file write and snapshot copy first sleeps a random time while training goes on
      and saves come at random steps (two on consecutive steps); then each committed tag's files are
      compared with the references.

A CheckpointFailedError is recorded with its call ("step", "save", "wait"), step and the 'latest'
of that moment instead of ending the run: a training loop that logs the failure and goes on.
"""

import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

import lazyzero
from lazyzero.checkpoint import commit, durable_io, faults, lazy_engine
from lazyzero.checkpoint.folder_layout import TEMP_PREFIX, read_latest
from lazyzero.checkpoint.lazy_engine import CheckpointFailedError
from lazyzero.checkpoint.manifest import committed_tags
from lazyzero.checkpoint.rank_state import rank_state_path
from lazyzero.testing import destroy_engine, worker_args

INPUTS, OUTPUTS, BATCH = 16, 4, 4
# Far longer than a flush of this model takes, even on a loaded machine: after it, a writer failure
# is known and the next call must raise it.
FLUSH_GRACE_S = 3.0


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(INPUTS, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48), torch.nn.Tanh(),
                               torch.nn.Linear(48, OUTPUTS))


def ds_config(stage: int, **checkpoint) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        # The LR changes every step, so a checkpoint of the wrong step differs in the scheduler too.
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 50}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
        "lazyzero": {"checkpoint": {"enabled": True, **checkpoint}},
    }


def new_engine(stage: int, **checkpoint):
    model = build_model()
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(stage, **checkpoint))
    return engine


def train_step(engine, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + engine.global_rank)
    inputs = torch.randn(BATCH, INPUTS, generator=generator)
    targets = torch.randn(BATCH, OUTPUTS, generator=generator)
    loss = torch.nn.functional.mse_loss(engine(inputs), targets)
    engine.backward(loss)
    engine.step()
    return loss


def flatten(value, prefix: str = "") -> dict:
    """Tensors (cloned) and plain values of a nested state, by path. Other objects (DeepSpeed's
    loss scaler, slice mappings) are derived from the rest, not state of their own."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flatten(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in flatten(item, f"{prefix}/{i}").items()}
    if isinstance(value, torch.Tensor):
        return {prefix: value.detach().clone()}
    for plain in (bool, int, float, str):  # bool first: it is an int; enums become their value
        if isinstance(value, plain):
            return {prefix: plain(value)}
    return {prefix: None} if value is None else {}


def state_of(engine, with_module: bool = True) -> dict:
    """What a checkpoint restores on this rank, flattened (see the module docstring); without the
    module's parameters where the checkpoint keeps them only in the optimizer's state (ZeRO-3)."""
    parameters = {name: getattr(p, "ds_tensor", p) for name, p in engine.module.named_parameters()}
    return flatten({"module": parameters if with_module else {}, "optimizer": engine.optimizer.state_dict(),
                    "lr_scheduler": engine.lr_scheduler.state_dict(), "global_steps": engine.global_steps,
                    "rng": torch.get_rng_state()})


def saved_state(tag_dir: Path, rank: int, stage: int = 2) -> dict:
    """`state_of` as this rank's files of a tag hold it (DeepSpeed's file names). A ZeRO-3 model file
    holds empty parameters (the partitions are the optimizer's fp32 groups): its "module" is empty."""
    def read(name):
        return torch.load(tag_dir / name, map_location="cpu", weights_only=False)

    model = read(f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt")
    optimizer = read(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    rng = read(rank_state_path(".", rank).name)["features"]["rng"]["cpu"]
    return flatten({"module": model["module"] if stage != 3 else {}, "optimizer": optimizer,
                    "lr_scheduler": model["lr_scheduler"], "global_steps": model["global_steps"], "rng": rng})


def differences(found: dict, expected: dict) -> list[str]:
    """Every path whose value differs bit for bit (atol=0, rtol=0) or exists on one side only."""
    problems = [f"{path}: missing" for path in expected if path not in found]
    problems += [f"{path}: not expected" for path in found if path not in expected]
    for path in expected.keys() & found.keys():
        a, b = found[path], expected[path]
        if isinstance(b, torch.Tensor):
            same = isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            same = type(a) is type(b) and a == b
        if not same:
            problems.append(f"{path}: found {a!r:.60}, expected {b!r:.60}")
    return sorted(problems)


class Recorder:
    """The calls of a training loop; each CheckpointFailedError is recorded, not raised. Every save
    first writes its reference to `references` (when given)."""

    def __init__(self, engine, save_dir: Path, references: Path | None = None):
        self.engine, self.save_dir, self.references = engine, save_dir, references
        self.errors: list[dict] = []
        self.step_count = 0
        if references is not None:
            references.mkdir(parents=True, exist_ok=True)

    def _call(self, kind: str, function, *args, **kwargs) -> bool:
        try:
            function(*args, **kwargs)
            return True
        except CheckpointFailedError as err:
            temporary = sorted(p.name for p in self.save_dir.iterdir() if p.name.startswith("."))
            self.errors.append({"call": kind, "step": self.step_count, "message": str(err),
                                "latest": read_latest(self.save_dir), "temporary": temporary})
            return False

    def step(self, count: int = 1) -> None:
        """Train; a failure raised by engine.step() comes before the optimizer step, which the loop
        then takes again (once)."""
        for _ in range(count):
            self.step_count += 1
            if not self._call("step", train_step, self.engine, self.step_count):
                self._call("step", self.engine.step)

    def save(self, **client_state) -> str:
        """Save tag step<n>; if the save reports an earlier failure instead, save again (once)."""
        tag = f"step{self.step_count}"
        if self.references is not None:
            torch.save(state_of(self.engine), self.references / f"{tag}.pt")
        for _ in range(2):
            if self._call("save", self.engine.save_checkpoint, str(self.save_dir), tag=tag,
                          client_state={"step": self.step_count, **client_state}):
                break
        return tag

    def wait(self) -> None:
        self._call("wait", self.engine.wait_for_checkpoints)


def train(out: Path, save_dir: Path, stage: int, steps: int, save_every: int) -> dict:
    engine = new_engine(stage)
    recorder = Recorder(engine, save_dir, out / "ref" / f"rank{engine.global_rank}")
    for _ in range(steps // save_every):
        recorder.step(save_every)
        recorder.save()
    recorder.wait()
    destroy_engine(engine)
    return {"errors": recorder.errors, "committed": committed_tags(save_dir), "latest": read_latest(save_dir)}


def load_and_compare(stage: int, save_dir: Path, references: Path, tag: str | None = None) -> dict:
    """A fresh engine (ZeRO-3 cannot load into one that trained) loads `tag` (None: the tag
    load_checkpoint resolves) and compares its state with the reference of the loaded step."""
    engine = new_engine(stage)
    load_path, client_state = engine.load_checkpoint(str(save_dir), tag=tag)
    result = {"tag": None}
    if load_path is not None:
        step = client_state["step"]
        expected = torch.load(references / f"rank{engine.global_rank}" / f"step{step}.pt", weights_only=True)
        result = {"tag": Path(load_path).parent.name, "step": step, "compared": len(expected),
                  "differences": differences(state_of(engine), expected)}
    destroy_engine(engine)
    return result


def load(out: Path, cases: list[str]) -> dict:
    results = {}
    for case in cases:
        stage, save_dir, references = case.split(":")
        results[save_dir] = load_and_compare(int(stage), Path(save_dir), Path(references))
    return results


class IoFaults:
    """Arms LAZYZERO_IO_FAULT for one save, with N counted from the start of that save, and records
    where each injected error hit. faults.py counts, per process, the calls of the kind the variable
    names (`faults._io_calls`); the N given to it is that count plus the N of the case."""

    def __init__(self):
        self.calls = Counter()  # every call, by kind: one clean checkpoint's counts resolve N < 0
        self.hits: list[dict] = []
        self.case: int | None = None  # index of the case armed last
        original = durable_io.io_fault

        def traced(op: str, path: str) -> None:
            self.calls[op] += 1
            try:
                original(op, path)
            except OSError as err:
                self.hits.append({"case": self.case, "op": op, "path": path, "error": str(err)})
                raise

        durable_io.io_fault = traced  # looked up at each call by durable_io's writers

    def arm(self, case: int, fault: str, per_checkpoint: Counter) -> None:
        self.case = case
        body, _, rank = fault.partition("@")
        op, nth, *errno = body.split(":")
        nth = int(nth) if int(nth) > 0 else per_checkpoint[op] + 1 + int(nth)
        spec = ":".join([op, str(faults._io_calls[op] + nth), *errno])
        os.environ["LAZYZERO_IO_FAULT"] = spec + (f"@{rank}" if rank else "")

    def disarm(self) -> None:
        os.environ.pop("LAZYZERO_IO_FAULT", None)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def io_faults(engine, save_dir: Path, references: Path, fault_cases: list[str]) -> dict:
    injector = IoFaults()
    recorder = Recorder(engine, save_dir, references)
    descriptors_before = open_descriptors()
    recorder.step(2)
    recorder.save()
    recorder.wait()
    per_checkpoint = Counter(injector.calls)  # one clean checkpoint's I/O calls on this rank
    cases = []
    for index, case in enumerate(fault_cases):
        fault, then = case.split("/")
        recorder.step(2)
        clean = recorder.save()
        recorder.step()
        recorder.wait()  # the clean one is committed and the fault counts from the next save only
        injector.arm(index, fault, per_checkpoint)
        faulty = recorder.save()
        if then == "wait":
            recorder.wait()
        cases.append({"fault": case, "clean": clean, "faulty": faulty})
    recorder.step(2)
    final = recorder.save()
    recorder.wait()
    injector.disarm()
    return {"cases": cases, "final": final, "errors": recorder.errors, "hits": injector.hits,
            "per_checkpoint": per_checkpoint, "descriptors_before": descriptors_before,
            "descriptors_after": open_descriptors(), "committed": committed_tags(save_dir),
            "latest": read_latest(save_dir)}


def writer_error(engine, save_dir: Path, references: Path) -> dict:
    """Per place the failure is looked for: a clean save, then one whose client_state torch.save
    cannot pickle (a lambda), raising in the writer thread of rank 0 (which writes the model file)."""
    recorder = Recorder(engine, save_dir, references)
    cases = []
    for where in ("step", "save", "wait"):
        recorder.step()
        clean = recorder.save()
        recorder.wait()
        recorder.step()
        first_error = len(recorder.errors)
        faulty = recorder.save(callback=lambda: None)
        if where != "wait":
            time.sleep(FLUSH_GRACE_S)
        if where == "step":
            recorder.step()
        elif where == "save":
            recorder.save()  # the same tag, saved again once the failure is raised
        recorder.wait()
        cases.append({"where": where, "clean": clean, "faulty": faulty, "errors": recorder.errors[first_error:]})
    recorder.step()
    final = recorder.save()
    recorder.wait()
    return {"cases": cases, "final": final, "errors": recorder.errors, "committed": committed_tags(save_dir),
            "latest": read_latest(save_dir)}


def errors(out: Path, fault_cases: list[str]) -> dict:
    """Both phases on one engine, in their own save_dir and reference folders (their tags overlap)."""
    engine = new_engine(2)
    rank = f"rank{engine.global_rank}"
    result = {"io": io_faults(engine, out / "io", out / "ref_io" / rank, fault_cases),
              "writer": writer_error(engine, out / "writer", out / "ref_writer" / rank)}
    destroy_engine(engine)
    for name, phase in result.items():
        phase["loads"] = {tag: load_and_compare(2, out / name, out / f"ref_{name}", tag)
                          for tag in committed_tags(out / name)}
    return result


class SlowWriter:
    """Random sleeps before each file write (commit.write_file), before each snapshot's copies
    (lazy_engine.run_copies) and before each rank's fsyncs (lazy_engine.make_durable); the names
    are looked up at each call, by commit.write_files, the copy thread and the flush thread. Host
    tensors' files are written before the next step, so it is mostly the fsyncs that run while
    training goes on. Records which tags' files are being written or made durable at any moment."""

    def __init__(self, seed: int, longest_write_s: float, longest_copy_s: float):
        self._random, self._lock = random.Random(seed), threading.Lock()
        self._longest = {"write": longest_write_s, "copy": longest_copy_s, "durable": longest_write_s}
        self.writing = Counter()  # tag -> files being written now
        self.calls = Counter()
        self._originals = (commit.write_file, lazy_engine.run_copies, lazy_engine.make_durable)
        commit.write_file, lazy_engine.run_copies, lazy_engine.make_durable = self._write, self._copy, self._durable

    def _pause(self, kind: str) -> None:
        with self._lock:
            self.calls[kind] += 1
            pause = self._random.uniform(0.0, self._longest[kind])
        time.sleep(pause)

    def _copy(self, files, pace=None) -> None:
        self._pause("copy")
        self._originals[1](files, pace)

    def _write(self, snap, folder: Path, fail_midway: bool, blocks):
        with self._busy(folder.name.rsplit(".", 1)[-1]):  # .lazyzero-tmp.<tag>
            self._pause("write")
            return self._originals[0](snap, folder, fail_midway, blocks)

    def _durable(self, written, rank, pool):
        tag = next((part.rsplit(".", 1)[-1] for w in written[:1] for part in w.path.parts
                    if part.startswith(TEMP_PREFIX)), "?")
        with self._busy(tag):
            self._pause("durable")
            return self._originals[2](written, rank, pool)

    @contextlib.contextmanager
    def _busy(self, tag: str):
        with self._lock:
            self.writing[tag] += 1
        try:
            yield
        finally:
            with self._lock:
                self.writing[tag] -= 1

    def tags_being_written(self) -> list[str]:
        with self._lock:
            return sorted(tag for tag, count in self.writing.items() if count > 0)

    def remove(self) -> None:
        commit.write_file, lazy_engine.run_copies, lazy_engine.make_durable = self._originals


def slow_writer_run(out: Path, seed: int, max_in_flight: int, stage: int, share: float | None = None,
                    steps: int = 16) -> dict:
    """Saves at random steps, the same on every rank (the save is collective), always including two
    consecutive steps; each reference kept in memory and compared with the files at the end. `share`:
    the background copies' copy_bandwidth_share (background_pace.py)."""
    schedule = random.Random(seed)
    first_pair = schedule.randrange(1, steps)
    save_steps = sorted({first_pair, first_pair + 1, *schedule.sample(range(1, steps + 1), 5)})
    engine = new_engine(stage, max_in_flight=max_in_flight, copy_bandwidth_share=share)
    writer = SlowWriter(seed * 10 + engine.global_rank, longest_write_s=0.25, longest_copy_s=0.05)
    save_dir = out / f"slow_seed{seed}"
    references, saves, steps_during_writes = {}, [], 0
    for step in range(1, steps + 1):
        steps_during_writes += bool(writer.tags_being_written())
        train_step(engine, step)
        if step in save_steps:
            tag = f"step{step}"
            references[tag] = state_of(engine, with_module=stage != 3)
            busy = writer.tags_being_written()
            started = time.monotonic()
            engine.save_checkpoint(str(save_dir), tag=tag, client_state={"step": step})
            saves.append({"tag": tag, "busy_at_call": busy, "save_s": time.monotonic() - started,
                          "others_busy_at_return": [t for t in writer.tags_being_written() if t != tag]})
    engine.wait_for_checkpoints()
    pace_closes = dict(engine.checkpoint_engine.pace.close_counts)
    destroy_engine(engine)
    writer.remove()
    committed = committed_tags(save_dir)
    mismatches = {tag: differences(saved_state(save_dir / tag, dist.get_rank(), stage), references[tag])
                  for tag in committed}
    return {"seed": seed, "max_in_flight": max_in_flight, "stage": stage, "saves": saves, "committed": committed,
            "latest": read_latest(save_dir), "compared": {tag: len(references[tag]) for tag in committed},
            "differences": mismatches, "slowed_calls": writer.calls, "steps_during_writes": steps_during_writes,
            "steps": steps, "pace_closes": pace_closes}


def slow_writer(out: Path, runs: list[str]) -> dict:
    """`runs`: SEED:MAX_IN_FLIGHT:ZERO_STAGE[:COPY_BANDWIDTH_SHARE] each."""
    results = {}
    for run in runs:
        seed, max_in_flight, stage, *share = run.split(":")
        results[run] = slow_writer_run(out, int(seed), int(max_in_flight), int(stage),
                                       float(share[0]) if share else None)
    return results


def main() -> None:
    args = worker_args()
    mode, out = args[0], Path(args[1])
    if mode == "train":
        result = train(out, Path(args[2]), int(args[3]), int(args[4]), int(args[5]))
    elif mode == "load":
        result = load(out, args[2:])
    elif mode == "errors":
        result = errors(out, args[2:])
    elif mode == "slow_writer":
        result = slow_writer(out, args[2:])
    else:
        raise SystemExit(f"lazy_ckpt_worker.py: mode {mode!r}; allowed: train, load, errors, slow_writer")
    (out / f"{mode}_rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
