"""Run 5 steps with plain deepspeed.initialize and with lazyzero.initialize (features off) per ZeRO
setting, in one process per rank, and write the losses to OUT/rank{r}.json.

Usage (under a launcher): equivalence_worker.py OUT SETTING [SETTING ...]
SETTING is a stage ("0".."3"), optionally with CPU offload ("2+cpu": optimizer state; "3+cpu":
optimizer state and parameters).
"""

import json
from pathlib import Path

import deepspeed
import torch

import lazyzero
from lazyzero.models import build_model
from lazyzero.testing import destroy_engine, worker_args

STEPS = 5


def ds_config(setting: str, with_section: bool) -> dict:
    stage, _, offload = setting.partition("+")
    zero = {"stage": int(stage), "reduce_bucket_size": 5000, "stage3_param_persistence_threshold": 0}
    if offload == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
        if zero["stage"] == 3:
            zero["offload_param"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        # Without offload, torch's AdamW (no JIT build); with it, DeepSpeed's CPU Adam, as users get.
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": not offload}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if with_section:
        config["lazyzero"] = {"gradients": {"enabled": False}, "checkpoint": {"enabled": False}}
    return config


def train_losses(init, setting: str, with_section: bool) -> tuple[str, list[float]]:
    model = build_model("tiny", seed=7, vocab_size=300)
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=ds_config(setting, with_section))
    generator = torch.Generator().manual_seed(100 + engine.global_rank)
    losses = []
    for _ in range(STEPS * engine.gradient_accumulation_steps()):
        ids = torch.randint(0, 300, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    kind = type(engine).__name__
    destroy_engine(engine)
    return kind, losses


def main() -> None:
    args = worker_args()
    out, settings = Path(args[0]), args[1:]
    result = {}
    for setting in settings:
        print(f"equivalence_worker: setting {setting}", flush=True)
        ds_kind, ds_losses = train_losses(deepspeed.initialize, setting, with_section=False)
        lz_kind, lz_losses = train_losses(lazyzero.initialize, setting, with_section=True)
        result[setting] = {"deepspeed": ds_losses, "lazyzero": lz_losses, "engines": [ds_kind, lz_kind]}
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
