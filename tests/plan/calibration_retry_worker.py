"""Every rank runs the planner's engine calibration on the tiny model at once; each writes the step
times it obtained to OUT/rank{r}.json. With LAZYZERO_CALIBRATION_ABORT set, one rank's first child
aborts before its result (engine_calibration.SIGNAL_RETRIES).

Usage (under the deepspeed launcher, 2 ranks): calibration_retry_worker.py OUT
"""

import json
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from lazyzero.models import build_model
from lazyzero.plan.profile.engine_calibration import calibrate_engine
from lazyzero.testing import worker_args

CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def main() -> None:
    out = Path(worker_args()[0])
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model("tiny", seed=1, vocab_size=300)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    calibration = calibrate_engine(model, CONFIG, {"input_ids": ids, "labels": ids}, steps=1)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps([run.layers for run in calibration.runs]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
