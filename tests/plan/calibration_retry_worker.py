"""Every rank runs the planner's engine calibration on the tiny model, 4 layers deep, at once; each writes the step
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


def deepen(model, layers: int):
    """`model`'s architecture with `layers` decoder layers."""
    from transformers import AutoModelForCausalLM

    config = model.config
    config.num_hidden_layers = layers
    return AutoModelForCausalLM.from_config(config)


def main() -> None:
    out = Path(worker_args()[0])
    deepspeed.init_distributed(dist_backend="gloo")
    # Four decoder layers, one more than the second engine: a model held whole is also run at its own depth.
    model = deepen(build_model("tiny", seed=1, vocab_size=300), 4)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    calibration = calibrate_engine(model, CONFIG, {"input_ids": ids, "labels": ids}, steps=1)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps([run.layers for run in calibration.runs]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
