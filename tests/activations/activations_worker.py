"""Saved-activation quantization inside real DeepSpeed runs, 2 ranks (tests/activations/test_engine_activations.py
and, for offload, tests/activations/test_offload.py).

Usage (under the deepspeed launcher): `activations_worker.py OUT LAYOUT ...`, LAYOUT =
STAGE[+recompute][+offload]. For each layout the tiny Llama preset trains 3 steps from the same seed
and data in two runs: with activations off, then with `"lazyzero": {"activations": {"enabled": true}}`
(plus `recompute_layers: [0]` for +recompute). With +offload the two runs are instead "on" (the
same policy) and "offload": layer 0 offloaded to NVMe, files under OUT/nvme. Each rank writes
OUT/rank<r>.json: per layout and run the losses, the engine's activation metrics per step, its
report, and every parameter's values after the steps (whole, gathered under ZeRO-3) as lists.
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

import lazyzero
from lazyzero.models.build import build_model
from lazyzero.testing import destroy_engine, worker_args

BATCH, SEQ, STEPS = 4, 64, 3


def ds_config(layout: str, run: str, out: str) -> dict:
    stage, *flags = layout.split("+")
    zero = {"stage": int(stage)}
    if int(stage) == 3:
        zero["stage3_param_persistence_threshold"] = 0  # norms' weights partitioned too
    activations = {"enabled": True, "recompute_layers": [0] if "recompute" in flags else []}
    if run == "offload":
        activations.update(offload_layers={"0": "nvme"}, offload_nvme_path=str(Path(out, "nvme")))
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "lazyzero": {"activations": activations} if run != "off" else {},
    }


def batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=generator)


def train(layout: str, run: str, out: str) -> dict:
    model = build_model("tiny", seed=0)
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config(layout, run, out))
    losses, metrics = [], []
    for step in range(STEPS):
        ids = batch(step, dist.get_rank(), model.config.vocab_size)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        metrics.append(engine.lazyzero_step_metrics())
    report = engine.lazyzero_report()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None,
                                           enabled=engine.zero_optimization_stage() == 3):
        values = {name: p.detach().float().flatten().tolist() for name, p in engine.module.named_parameters()}
    destroy_engine(engine)
    return {"losses": losses, "metrics": metrics, "report": report, "params": values}


def main() -> None:
    out, *layouts = worker_args()
    result = {}
    for layout in layouts:
        runs = ("on", "offload") if "offload" in layout.split("+") else ("off", "on")
        result[layout] = {run: train(layout, run, out) for run in runs}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
