"""A rank that dies or stops while the others train and checkpoint (docs/reliability.md, guarantee 5).

Usage (2 ranks, under the deepspeed launcher or mpirun): dead_rank_worker.py OUT TIMEOUT_S [FAULT]
A small MLP trains 6 steps with ZeRO-2, lazy checkpoints and `lazyzero.distributed.timeout_s`
TIMEOUT_S; step2 is saved and committed (`latest`), step4 is saved in the background.
FAULT is VICTIM:SIGNAL:STEP: before the forward of step STEP, rank VICTIM sends itself SIGNAL
(SIGKILL, SIGSTOP) or exits with code 0 ("exit"), so its peer waits in that step's gradient
collective. Faults inside a checkpoint come from LAZYZERO_FAILPOINT (and LAZYZERO_FAILPOINT_SIGNAL)
in the environment instead.

Each rank writes OUT/pid_rank<r> (its pid and process group) once torch.distributed is up; a rank
that leaves by an exception first writes OUT/error_rank<r>.json (the exception, and how long the
call that raised had been waiting), then lets it end the process; a rank that finishes writes
OUT/done_rank<r>.json.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

import lazyzero
from lazyzero.testing import worker_args

INPUTS, OUTPUTS, BATCH = 16, 4, 4


def new_engine(timeout_s: float):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(INPUTS, 32), torch.nn.Tanh(), torch.nn.Linear(32, OUTPUTS))
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "steps_per_print": 10**9,
              "lazyzero": {"checkpoint": {"enabled": True}, "distributed": {"timeout_s": timeout_s}}}
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine, step: int) -> None:
    generator = torch.Generator().manual_seed(1000 * step + engine.global_rank)
    inputs, targets = torch.randn(BATCH, INPUTS, generator=generator), torch.randn(BATCH, OUTPUTS, generator=generator)
    engine.backward(torch.nn.functional.mse_loss(engine(inputs), targets))
    engine.step()


def hurt_self(how: str) -> None:
    if how == "exit":
        os._exit(0)
    os.kill(os.getpid(), getattr(signal, how))


class Calls:
    """When the current call began, so that an error can say how long it waited."""

    def __init__(self):
        self.name, self.started = "start", time.monotonic()

    def begin(self, name: str) -> None:
        self.name, self.started = name, time.monotonic()


def run(out: Path, timeout_s: float, fault: str | None, calls: Calls) -> None:
    engine = new_engine(timeout_s)
    rank = engine.global_rank
    (out / f"pid_rank{rank}").write_text(f"{os.getpid()} {os.getpgid(0)}")
    victim, how, fault_step = fault.split(":") if fault else (None, None, "0")
    for step in range(1, 7):
        if victim is not None and int(victim) == rank and step == int(fault_step):
            hurt_self(how)
        calls.begin(f"step {step}")
        train_step(engine, step)
        if step in (2, 4):
            calls.begin(f"save step{step}")
            engine.save_checkpoint(str(out / "ckpt"), tag=f"step{step}")
        if step == 2:
            calls.begin("wait step2")
            engine.wait_for_checkpoints()
    calls.begin("wait")
    engine.wait_for_checkpoints()
    (out / f"done_rank{rank}.json").write_text(json.dumps({"rank": rank}))


def main() -> None:
    args = worker_args()
    out, timeout_s, fault = Path(args[0]), float(args[1]), (args[2] if len(args) > 2 else None)
    calls = Calls()
    try:
        run(out, timeout_s, fault, calls)
    except BaseException as err:
        rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
        record = {"rank": rank, "call": calls.name, "waited_s": time.monotonic() - calls.started,
                  "type": type(err).__name__, "message": str(err)[:2000]}
        (out / f"error_rank{rank}.json").write_text(json.dumps(record))
        raise
    sys.exit(0)


if __name__ == "__main__":
    main()
