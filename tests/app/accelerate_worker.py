"""A plain Accelerate training script with the one line `lazyzero.patch_deepspeed()` added; run by
tests/app/test_trainers.py on 2 CPU ranks (`deepspeed --num_gpus 2`).

Arguments: OUT_DIR DS_CONFIG [torch-optimizer | resume | patch-late]. The optimizer is the config's
(Accelerate's `DummyOptim`), or with "torch-optimizer" a torch AdamW from code, which lazyzero's 8-bit
optimizer refuses. With "patch-late" the script builds its Accelerator before `lazyzero.patch_deepspeed()`,
so Accelerate counts one process on CPU ranks and lazyzero refuses at `prepare`. States are saved with
Accelerate's automatic naming (OUT_DIR/checkpoints/checkpoint_<i>) every SAVE_EVERY steps; right after
each save every rank draws from torch's generator. With "resume" the run
starts with `load_state()` of the newest folder, draws, skips the batches already trained and goes on.
Each rank seeds torch's generator with its rank, so that the ranks' random states differ. Rank 0
writes OUT_DIR/result.json: the engine's class, the lazyzero metrics of every step, the checkpoint
folders, and per rank its losses, the sum of each batch's token ids and its draws; or the refusal.
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin, DummyOptim, ProjectConfiguration
from torch.utils.data import DataLoader

import lazyzero
from lazyzero.app.data.arithmetic import format_example, generate_problems
from lazyzero.app.data.dataset import TokenizedExamples
from lazyzero.app.data.tokenizer import ByteTokenizer
from lazyzero.models import build_model

STEPS = 5
SAVE_EVERY = 2


class Progress:
    """The number of steps trained, saved and loaded with Accelerate's states (register_for_checkpointing)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def write_result(out: str, result: dict) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))


def main() -> None:
    out, ds_config, *mode = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    if mode != ["patch-late"]:
        lazyzero.patch_deepspeed()  # the one line this script adds to a plain Accelerate script
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
                              project_config=ProjectConfiguration(project_dir=out, automatic_checkpoint_naming=True))
    if mode == ["patch-late"]:
        lazyzero.patch_deepspeed()  # after Accelerate counted its processes
    tokenizer = ByteTokenizer()
    texts = [format_example(problem) for problem in generate_problems(64, seed=0, split="train")]
    loader = DataLoader(TokenizedExamples(texts, tokenizer, seq_len=64), batch_size=4, shuffle=False)
    model = build_model("tiny", vocab_size=tokenizer.vocab_size, seed=0)
    torch.manual_seed(1000 + int(os.environ.get("RANK", "0")))
    if mode == ["torch-optimizer"]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    else:
        optimizer = DummyOptim(model.parameters(), lr=2e-3, weight_decay=0.0)
    try:
        engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    except ValueError as refusal:
        write_result(out, {"refusal": str(refusal)})
        return
    progress, mine = Progress(), {"losses": {}, "batch_sums": {}, "draws": {}}
    accelerator.register_for_checkpointing(progress)
    if mode == ["resume"]:
        accelerator.load_state()
        mine["draws"][progress.step] = torch.rand(3).tolist()
        accelerator.project_configuration.iteration = len(list((Path(out) / "checkpoints").iterdir()))
    metrics = train(accelerator, engine, optimizer, accelerator.skip_first_batches(loader, progress.step), progress,
                    mine)
    engine.wait_for_checkpoints()
    ranks = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(ranks, mine)
    checkpoints = Path(out) / "checkpoints"
    write_result(out, {"engine_class": type(engine).__name__, "num_processes": accelerator.num_processes,
                       "is_lazyzero": isinstance(engine, lazyzero.LazyZeroEngine),
                       "features": engine.lazyzero_config.enabled_features(), "metrics": metrics, "ranks": ranks,
                       "checkpoints": sorted(p.name for p in checkpoints.iterdir()),
                       "random_states": sorted(str(p.relative_to(checkpoints))
                                               for p in checkpoints.glob("*/random_states_*")),
                       "optimizer_class": type(engine.basic_optimizer).__name__})
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


def train(accelerator, engine, optimizer, loader, progress, mine) -> list[dict]:
    """Steps progress.step + 1 to STEPS: each rank's loss and batch, a save every SAVE_EVERY steps."""
    metrics = []
    for step, batch in zip(range(progress.step + 1, STEPS + 1), loader):
        loss = engine(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mine["losses"][step], mine["batch_sums"][step] = loss.item(), int(batch["input_ids"].sum())
        metrics.append({"step": step, **engine.lazyzero_step_metrics()})
        progress.step = step
        if step % SAVE_EVERY == 0:
            accelerator.save_state()
            mine["draws"][step] = torch.rand(3).tolist()
    return metrics


if __name__ == "__main__":
    main()
