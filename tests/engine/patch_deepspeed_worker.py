"""`deepspeed.initialize` after `lazyzero.patch_deepspeed()`, on one real rank: run by
tests/engine/test_patch_deepspeed.py. Argument: OUT_DIR; writes OUT_DIR/result.json."""

import base64
import json
import sys
from pathlib import Path

import deepspeed
import torch

import lazyzero
from lazyzero.config import LazyZeroConfigError
from lazyzero.models import build_model
from lazyzero.testing import destroy_engine

PLAIN = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
         "zero_optimization": {"stage": 1}, "steps_per_print": 1000000}


def engine_class(**arguments) -> str:
    model = build_model("tiny", seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), **arguments)
    name = type(engine).__name__
    destroy_engine(engine)
    return name


def main() -> None:
    out = Path([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    result = {"before": engine_class(config=dict(PLAIN, lazyzero={}))}
    lazyzero.patch_deepspeed()
    lazyzero.patch_deepspeed()  # a second call changes nothing
    path = out / "with_section.json"
    path.write_text(json.dumps(dict(PLAIN, lazyzero={"optimizer": {"enabled": True}})))
    result.update(
        plain=engine_class(config=PLAIN),
        plain_params=engine_class(config_params=PLAIN),
        section=engine_class(config=dict(PLAIN, lazyzero={})),
        section_from_file=engine_class(config=str(path)),
        section_as_config_params=engine_class(config_params=dict(PLAIN, lazyzero={})),
        section_as_base64=engine_class(config=base64.urlsafe_b64encode(
            json.dumps(dict(PLAIN, lazyzero={})).encode()).decode()))
    try:
        engine_class(config=dict(PLAIN, lazyzero={"optimizer": {"enabled": "yes"}}))
    except LazyZeroConfigError as error:
        result["invalid"] = str(error)
    result["unpatched"] = lazyzero.unpatch_deepspeed()
    result["after"] = engine_class(config=dict(PLAIN, lazyzero={}))
    (out / "result.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
