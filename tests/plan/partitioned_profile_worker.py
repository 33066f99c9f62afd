"""Profiles the tiny model built whole, under `deepspeed.zero.Init` (with the whole one's weights) and
on the meta device, in one single-rank process (tests/plan/test_partitioned_models.py).

Usage: python partitioned_profile_worker.py OUT.json   (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)
OUT.json: per form, every layer's sizes and gradient errors as the profile has them.
"""

import dataclasses
import json

import deepspeed
import torch

from lazyzero.models import build_model
from lazyzero.plan.profile.profiler import ProfileSettings, profile_model
from lazyzero.testing import worker_args

VOCAB = 300
FAST = ProfileSettings(repeats=1, warmup=0, optimizer_elements=1 << 16, host_copy_bytes=1 << 20, nvme_bytes=1 << 20,
                       measure_memory=False)
SIZES = ("name", "measured_as", "act_bytes", "input_bytes", "output_bytes", "tensors", "grad_error")


def forms() -> dict:
    whole = build_model("tiny", seed=1, vocab_size=VOCAB)
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}
    partitioned = build_model("tiny", seed=2, vocab_size=VOCAB, zero_init_config=config)
    with deepspeed.zero.GatheredParameters(list(partitioned.parameters()), modifier_rank=0):
        partitioned.load_state_dict(whole.state_dict())
    return {"whole": whole, "partitioned": partitioned, "meta": build_model("tiny", vocab_size=VOCAB, meta=True)}


def main() -> None:
    out = worker_args()[0]
    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for form, model in forms().items():
        profile = profile_model(model, micro_batch=2, seq_len=32, settings=FAST, progress=False)
        result[form] = [{key: value for key, value in dataclasses.asdict(layer).items() if key in SIZES}
                        for layer in profile.layers]
    with open(out, "w") as file:
        json.dump(result, file, default=str)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
