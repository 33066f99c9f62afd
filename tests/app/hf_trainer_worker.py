"""A plain Hugging Face Trainer script with the one line `lazyzero.patch_deepspeed()` added; run by
tests/app/test_trainers.py on 2 CPU ranks (`deepspeed --num_gpus 2`).

Arguments: OUT_DIR DS_CONFIG [STEPS [resume | example]]. Rank 0 writes OUT_DIR/result.json: the engine's
class, the lazyzero metrics of every step, the losses (and the step of each), the Trainer's log entries
(with the lazyzero metrics `TrainerLogsCallback` adds), the checkpoint folders the Trainer left, and the
folder it resumed from: with "resume" the Trainer's pick (`resume_from_checkpoint=True`), with "example"
the one transformers' example scripts pick (`get_last_checkpoint`, bound at import, before
`lazyzero.patch_deepspeed()` runs) and pass on. Every save is followed by a check, on rank 0, that some
committed checkpoint folder exists (`committed_at_save`).
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import lazyzero
from lazyzero.app.data.arithmetic import format_example, generate_problems
from lazyzero.app.data.dataset import TokenizedExamples
from lazyzero.app.data.tokenizer import ByteTokenizer
from lazyzero.checkpoint.manifest import committed_tags
from lazyzero.models import build_model

STEPS = 5


class CheckCommittedAfterSave(TrainerCallback):
    """After each save (and the Trainer's rotation), whether some checkpoint folder holds a committed one."""

    def __init__(self):
        self.committed_at_save = []

    def on_save(self, args, state, control, **kwargs):
        folders = sorted(Path(args.output_dir).glob("checkpoint-*"))
        self.committed_at_save.append(any(committed_tags(folder) for folder in folders))


class RecordLazyZeroMetrics(TrainerCallback):
    """The engine's lazyzero metrics after every optimizer step."""

    def __init__(self):
        self.trainer = None
        self.steps = []

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        self.steps.append({"step": state.global_step, **engine.lazyzero_step_metrics()})


def train_as_the_example_scripts(trainer, training_args):
    """The resume pattern of transformers' example scripts (examples/pytorch/language-modeling/run_clm.py
    and friends, 4.x), as written there, less `overwrite_output_dir`, which transformers 5 no longer has;
    the folder passed to train()."""
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is None and len(os.listdir(training_args.output_dir)) > 0:
            raise ValueError(
                f"Output directory ({training_args.output_dir}) already exists and is not empty. "
                "Use --overwrite_output_dir to overcome."
            )
    checkpoint = None
    if training_args.resume_from_checkpoint is not None:
        checkpoint = training_args.resume_from_checkpoint
    elif last_checkpoint is not None:
        checkpoint = last_checkpoint
    trainer.train(resume_from_checkpoint=checkpoint)
    return checkpoint


def main() -> None:
    out, ds_config, *rest = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    steps = int(rest[0]) if rest else STEPS
    mode = rest[1] if rest[1:] else None
    lazyzero.patch_deepspeed()  # the one line this script adds to a plain Trainer script

    tokenizer = ByteTokenizer()
    texts = [format_example(problem) for problem in generate_problems(64, seed=0, split="train")]
    train_set = TokenizedExamples(texts, tokenizer, seq_len=64)
    model = build_model("tiny", vocab_size=tokenizer.vocab_size, seed=0)
    args = TrainingArguments(output_dir=str(Path(out) / "trainer"), deepspeed=ds_config, use_cpu=True,
                             per_device_train_batch_size=4, max_steps=steps, learning_rate=2e-3,
                             save_steps=2, save_total_limit=1, logging_steps=1, report_to=[], seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, do_train=True)
    recorder, checker = RecordLazyZeroMetrics(), CheckCommittedAfterSave()
    trainer = Trainer(model=model, args=args, train_dataset=train_set,
                      callbacks=[recorder, checker, lazyzero.TrainerLogsCallback()])
    recorder.trainer = trainer
    if mode == "example":
        resumed_from = train_as_the_example_scripts(trainer, args)
    else:
        resumed_from = get_last_checkpoint(args.output_dir) if mode == "resume" else None  # what train() picks
        trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    engine = trainer.model_wrapped
    engine.wait_for_checkpoints()
    if int(os.environ.get("RANK", "0")) == 0:
        result = {"engine_class": type(engine).__name__, "is_lazyzero": isinstance(engine, lazyzero.LazyZeroEngine),
                  "features": engine.lazyzero_config.enabled_features(), "metrics": recorder.steps,
                  "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
                  "loss_steps": [entry["step"] for entry in trainer.state.log_history if "loss" in entry],
                  "logged": [entry for entry in trainer.state.log_history if "loss" in entry],
                  "resumed_from": resumed_from and Path(resumed_from).name,
                  "committed_at_save": checker.committed_at_save,
                  "checkpoints": sorted(p.name for p in Path(args.output_dir).glob("checkpoint-*")),
                  "optimizer_class": type(engine.basic_optimizer).__name__, "threads": torch.get_num_threads()}
        (Path(out) / "result.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
