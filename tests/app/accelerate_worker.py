"""A plain Accelerate training script with the one line `lazyzero.patch_deepspeed()` added; run by
tests/app/test_trainers.py on 2 CPU ranks (`deepspeed --num_gpus 2`).

Arguments: OUT_DIR DS_CONFIG [torch-optimizer]. The optimizer is the config's (Accelerate's
`DummyOptim`), or with "torch-optimizer" a torch AdamW from code, which lazyzero's 8-bit optimizer
refuses. Rank 0 writes OUT_DIR/result.json: the engine's class, the lazyzero metrics of every step,
the losses and the checkpoint folders; or the refusal.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DummyOptim
from torch.utils.data import DataLoader

import lazyzero
from lazyzero.app.data.arithmetic import format_example, generate_problems
from lazyzero.app.data.dataset import TokenizedExamples
from lazyzero.app.data.tokenizer import ByteTokenizer
from lazyzero.models import build_model

STEPS = 5
SAVE_EVERY = 2


def write_result(out: str, result: dict) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))


def main() -> None:
    out, ds_config, *mode = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    lazyzero.patch_deepspeed()  # the one line this script adds to a plain Accelerate script

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
    tokenizer = ByteTokenizer()
    texts = [format_example(problem) for problem in generate_problems(64, seed=0, split="train")]
    loader = DataLoader(TokenizedExamples(texts, tokenizer, seq_len=64), batch_size=4, shuffle=False)
    model = build_model("tiny", vocab_size=tokenizer.vocab_size, seed=0)
    if mode == ["torch-optimizer"]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    else:
        optimizer = DummyOptim(model.parameters(), lr=2e-3, weight_decay=0.0)
    try:
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    except ValueError as refusal:
        write_result(out, {"refusal": str(refusal)})
        return
    metrics, losses = [], []
    for step, batch in zip(range(1, STEPS + 1), loader):
        loss = engine(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        metrics.append({"step": step, **engine.lazyzero_step_metrics()})
        if step % SAVE_EVERY == 0:
            accelerator.save_state(str(Path(out) / "state" / f"step{step}"))
    engine.wait_for_checkpoints()
    write_result(out, {"engine_class": type(engine).__name__,
                       "is_lazyzero": isinstance(engine, lazyzero.LazyZeroEngine),
                       "features": engine.lazyzero_config.enabled_features(), "metrics": metrics, "losses": losses,
                       "checkpoints": sorted(p.name for p in (Path(out) / "state").iterdir()),
                       "optimizer_class": type(engine.basic_optimizer).__name__})
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
