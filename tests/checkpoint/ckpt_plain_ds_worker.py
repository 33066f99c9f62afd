"""Load checkpoints with PLAIN DeepSpeed (no lazyzero engine) and record what was loaded.

Usage (under a launcher): ckpt_plain_ds_worker.py CONFIG OUT NAME=DIR[@TAG] [NAME=DIR[@TAG] ...]

For each source, builds the model exactly as `lazyzero.train --model tiny` does (same seed, same
module structure), calls `deepspeed.initialize` with CONFIG minus its "lazyzero" section, then
`load_checkpoint(DIR, tag=TAG)` (TAG default: DeepSpeed reads DIR/latest). Rank 0 writes OUT/NAME.pt:
{"step": the client state's step, "params": every parameter gathered whole (ZeRO-3),
 "next_loss": the mean loss of the training step after `step`, on the batches lazyzero.train uses}.
"""

from pathlib import Path

import deepspeed
import torch

from lazyzero.app.data_order import StepBatches
from lazyzero.app.trainer import load_training_inputs
from lazyzero.config import load_ds_config_file
from lazyzero.testing import destroy_engine, worker_args
from lazyzero.train import build_parser

# The arguments of the run that wrote the checkpoints (tests/checkpoint/conftest.py); the rest default.
TRAIN_ARGS = ["--model", "tiny", "--train-examples", "200", "--eval-problems", "0"]


def load_with_plain_deepspeed(config_path: str, load_dir: str, tag: str | None) -> dict:
    train_args = build_parser().parse_args(["--deepspeed_config", config_path, *TRAIN_ARGS])
    inputs = load_training_inputs(train_args)
    config = {k: v for k, v in load_ds_config_file(config_path).items() if k != "lazyzero"}
    model = inputs.model
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=config)
    assert type(engine) is deepspeed.DeepSpeedEngine, type(engine)
    path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    assert path is not None, f"DeepSpeed loaded nothing from {load_dir} (tag {tag})"
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    step = int(client_state["step"])
    result = {"step": step, "params": params,
              "next_loss": next_step_loss(engine, inputs.train_set, step, train_args.seed)}
    destroy_engine(engine)
    return result


def next_step_loss(engine, train_set, step: int, seed: int) -> float:
    """The loss lazyzero.train logs for step `step + 1` (mean over ranks and micro-batches), computed
    the way its Trainer does, on the same batches: equal only if the loaded parameters are the run's."""
    accum = engine.gradient_accumulation_steps()
    batches = StepBatches(len(train_set), engine.train_micro_batch_size_per_gpu(), accum,
                          engine.global_rank, engine.world_size, seed)
    engine.train()
    total = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for micro in range(accum):
            items = [train_set[i] for i in batches.indices(step, micro)]
            batch = {k: torch.stack([it[k] for it in items]) for k in ("input_ids", "attention_mask", "labels")}
            total += engine(**batch).loss.item()
    torch.distributed.all_reduce(total)
    return total.item() / (engine.world_size * accum)


def main() -> None:
    args = worker_args()
    config_path, out, sources = args[0], Path(args[1]), args[2:]
    for source in sources:
        name, _, location = source.partition("=")
        load_dir, _, tag = location.partition("@")
        result = load_with_plain_deepspeed(config_path, load_dir, tag or None)
        if torch.distributed.get_rank() == 0:
            torch.save(result, out / f"{name}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
