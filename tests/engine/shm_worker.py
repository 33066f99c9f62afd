"""Does lazyzero.initialize release DeepSpeed's /dev/shm all-reduce files? Facts to OUT/rank{r}.json.

Usage (under the deepspeed launcher, 2 ranks): shm_worker.py OUT
"""

import json
import os
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import lazyzero
from lazyzero.distributed.shm_segments import segment_paths
from lazyzero.models import build_model
from lazyzero.testing import destroy_engine, worker_args

CONFIG = {"train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}


def main() -> None:
    out = Path(worker_args()[0])
    deepspeed.init_distributed(dist_backend="gloo")
    port = os.environ["MASTER_PORT"]
    before = len(segment_paths(port))
    model = build_model("tiny", seed=1, vocab_size=300)
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    dist.barrier()
    after = len(segment_paths(port))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(engine.global_rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    total = torch.tensor([loss.item()])
    deepspeed.comm.all_reduce(total)
    facts = {"segments_before": before, "segments_after": after, "all_reduce_finite": bool(torch.isfinite(total).all())}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(facts))
    destroy_engine(engine)


if __name__ == "__main__":
    main()
