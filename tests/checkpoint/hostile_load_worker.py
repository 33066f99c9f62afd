"""A LazyZeroEngine with lazy checkpoints off or on saves one checkpoint, or loads one, on 1 real rank
(tests/checkpoint/test_hostile_folders.py): whatever checkpoint engine reads the files, a file that
would run code is refused.

Usage (under the deepspeed launcher, 1 rank): hostile_load_worker.py save|load|save_outside SAVE_DIR LAZY
  LAZY is 0 (DeepSpeed's own checkpoint engine) or 1 (lazy checkpoints). load, and save_outside (a save
  with the tag "../escaped"), write SAVE_DIR/../load_result.json: {"error": type name, "message": str}
  or {"error": null}.
"""

import json
from pathlib import Path

import torch

import lazyzero
from lazyzero.testing import destroy_engine, worker_args


def build_engine(lazy: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "lazyzero": {"checkpoint": {"enabled": lazy}}}
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def main() -> None:
    mode, save_dir, lazy = worker_args()
    engine = build_engine(lazy == "1")
    if mode == "save":
        loss = engine(torch.randn(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(save_dir, tag="step1")
        engine.wait_for_checkpoints()
    else:
        result = {"error": None}
        try:
            if mode == "load":
                engine.load_checkpoint(save_dir)
            else:
                engine.save_checkpoint(save_dir, tag="../escaped")
        except Exception as err:  # what the test checks: the type and the message
            result = {"error": type(err).__name__, "message": str(err)}
        (Path(save_dir).parent / "load_result.json").write_text(json.dumps(result))
    destroy_engine(engine)


if __name__ == "__main__":
    main()
