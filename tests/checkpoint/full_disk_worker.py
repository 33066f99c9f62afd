"""A lazy checkpoint into a folder whose filesystem is too small for it, on 2 real ranks
(tests/checkpoint/test_full_disk.py).

Usage (under the deepspeed launcher): full_disk_worker.py SAVE_DIR RESULT_DIR
  Writes RESULT_DIR/rank<r>.json: {"error": type name or null, "message": str, "trained_after": bool}.
"""

import json
from pathlib import Path

import torch

import lazyzero
from lazyzero.testing import destroy_engine, worker_args


def main() -> None:
    save_dir, result_dir = worker_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "lazyzero": {"checkpoint": {"enabled": True}}}
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    result = {"error": None, "message": "", "trained_after": False}

    def step():
        loss = engine(torch.randn(2, 64)).pow(2).mean()
        engine.backward(loss)
        engine.step()

    step()
    try:
        engine.save_checkpoint(save_dir, tag="step1")
        engine.wait_for_checkpoints()
    except Exception as err:  # what the test checks: the type and the message
        result.update(error=type(err).__name__, message=str(err))
    step()  # training goes on after the failed save
    result["trained_after"] = True
    rank = torch.distributed.get_rank()
    (Path(result_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_engine(engine)


if __name__ == "__main__":
    main()
