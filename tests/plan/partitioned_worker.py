"""A planned run (`lazyzero.initialize` with plan.enabled) on a model built whole and on the same
model built under `deepspeed.zero.Init` (tests/plan/test_partitioned_models.py).

Usage (under the deepspeed launcher): partitioned_worker.py OUT CONFIG.json MODEL.json
Each rank writes OUT/rank<r>.json: per run ("partitioned", then "whole") the losses of STEPS steps on
the same batches, the ZeRO-3 tier report, the planned layers, the problem's per-layer parameter
bytes and whether the rank held the whole model when lazyzero.initialize was called. The partitioned
run measures the profile (its cache file is named in CONFIG); the whole run reuses it (same
architecture, shape and machine).
"""

import json
from pathlib import Path

import deepspeed
import torch
from deepspeed.runtime.zero.partition_parameters import Init

import lazyzero
from lazyzero.models import build_model
from lazyzero.plan.profile.materialize import holds_whole_model
from lazyzero.testing import destroy_engine, worker_args

STEPS, VOCAB, BATCH, SEQUENCE = 2, 300, 2, 32


def whole_model(spec: str):
    return build_model(spec, seed=1, vocab_size=VOCAB, dtype=torch.bfloat16)


def partitioned_model(spec: str, config: dict, weights: dict):
    """The same model, partitioned at construction; every rank loads rank 0's copy of `weights`."""
    model = build_model(spec, seed=2, vocab_size=VOCAB, dtype=torch.bfloat16, zero_init_config=config)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if torch.distributed.get_rank() == 0:
            model.load_state_dict(weights)
    return model


def run(model, config: dict) -> dict:
    record = {"held_whole": holds_whole_model(model)}
    Init.param_id = 0  # swap files are named by ds_id: numbered from 0 in both runs, as in a fresh process
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step * 10 + engine.global_rank)
        ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        record.setdefault("losses", []).append(loss.item())
    report = engine.lazyzero_report()
    record.update(tiers=report.get("zero_placement"), plan=report["plan"]["layers"])
    problem = engine.lazyzero_features.section("plan").active_plan.problem
    record["param_bytes"] = {layer.name: layer.param_bytes for layer in problem.layers}
    destroy_engine(engine)
    return record


def main() -> None:
    out, config_path, spec = map(Path, worker_args())
    config = json.loads(config_path.read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    model = whole_model(str(spec))
    partitioned = partitioned_model(str(spec), config, model.state_dict())
    records = {"partitioned": run(partitioned, config)}
    del partitioned
    records["whole"] = run(model, config)
    (out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(records))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
