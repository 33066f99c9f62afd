"""`lazyzero.train`, unchanged, that also writes this rank's whole training state at chosen steps
(tests/checkpoint/test_resume_state.py).

    deepspeed resume_state_worker.py DUMP_DIR STEPS -- <lazyzero.train arguments>

STEPS (comma-separated): after each of these optimizer steps (its checkpoint included) the state is
written to DUMP_DIR/step<N>_rank<R>.pt; a resumed run (--resume) also writes it right after loading
the checkpoint, before its first step, to DUMP_DIR/resumed<N>_rank<R>.pt. The state: the model's
parameters (this rank's ZeRO partition), the optimizer's master weights and every tensor of its state
(8-bit codes and scales), the int8 error-feedback residuals, the RNG states (torch, numpy, Python's
random), the learning rate, DeepSpeed's step counter and the data position (the example indices and
token ids of the next step's batch). Each step first draws a number from each of the three
generators, as a loop with augmentation or sampling would.
"""

import random
import sys
from pathlib import Path

import numpy as np
import torch

from lazyzero import train
from lazyzero.app import trainer as trainer_module
from lazyzero.testing import worker_args


def training_state(trainer, step: int) -> dict:
    engine = trainer.engine
    optimizer = engine.basic_optimizer
    # The fp32 master partitions, which the basic optimizer's state is keyed by: ZeRO-3 keeps them
    # outside its param groups between steps; at ZeRO 1 and 2 they are its parameters.
    masters = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or [
        p for group in optimizer.param_groups for p in group["params"]]
    exchange = engine.lazyzero_features.section("gradients").exchange
    accum = engine.gradient_accumulation_steps()
    return {
        "step": step,
        "global_steps": engine.global_steps,
        "lr": engine.get_lr(),
        "params": {name: getattr(p, "ds_tensor", p).detach().clone() for name, p in engine.module.named_parameters()},
        "masters": [p.detach().clone() for p in masters],
        "optimizer_state": [{key: value.clone() if torch.is_tensor(value) else value
                             for key, value in optimizer.state[p].items()} for p in masters],
        "error_feedback": exchange.state_dict() if exchange is not None else None,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "next_indices": [trainer.batches.indices(step, micro) for micro in range(accum)],
        "next_input_ids": trainer._batch(step, 0)["input_ids"],
    }


def state_dumping_trainer(dump_dir: Path, steps: set[int]):
    class StateDumpingTrainer(trainer_module.Trainer):
        def __init__(self, args, *rest, **kwargs):
            super().__init__(args, *rest, **kwargs)
            if args.resume:
                self._dump(f"resumed{self.start_step}", self.start_step)

        def _one_step(self, step: int) -> dict:
            # As a loop with augmentation or sampling does, each step draws from every generator;
            # lazyzero.train itself draws from none of them.
            torch.rand(1), np.random.rand(), random.random()
            record = super()._one_step(step)
            if step + 1 in steps:
                self._dump(f"step{step + 1}", step + 1)
            return record

        def _dump(self, label: str, step: int) -> None:
            # Every tensor is cloned first: the RNG, data and state reads above must not move anything.
            torch.save(training_state(self, step), dump_dir / f"{label}_rank{self.rank}.pt")

    return StateDumpingTrainer


def main() -> int:
    args = worker_args()
    dump_dir, steps, separator, train_argv = Path(args[0]), args[1], args[2], args[3:]
    assert separator == "--", args
    dump_dir.mkdir(parents=True, exist_ok=True)
    trainer_module.Trainer = state_dumping_trainer(dump_dir, {int(s) for s in steps.split(",")})
    return train.main(train_argv)


if __name__ == "__main__":
    sys.exit(main())
