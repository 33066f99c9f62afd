"""Fine-tune a Llama with the Hugging Face Trainer and lazyzero (README, "Using lazyzero with the
Hugging Face Trainer"): int8 gradients, 8-bit AdamW and lazy checkpoints from the DeepSpeed config.

    deepspeed --num_gpus 2 examples/hf_trainer.py --output-dir out --max-steps 40

Run the same command again to resume from the newest committed checkpoint (transformers' example
scripts' pattern) and train on to a larger --max-steps. Nothing else is needed at the end: the last
lazy checkpoint is committed when train() returns, and on SIGTERM every rank stops after the same
step, saves (with "save_on_sigterm": true in the config) and exits with status 143.
The model is lazyzero's `demo` preset (a 19M-parameter Llama, randomly initialized) and the data
lazyzero's arithmetic word problems; swap in your own model and dataset.
"""

import argparse
import os

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import lazyzero
from lazyzero.app.data.arithmetic import format_example, generate_problems
from lazyzero.app.data.dataset import TokenizedExamples
from lazyzero.app.data.tokenizer import ByteTokenizer
from lazyzero.models import build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--deepspeed-config", default="ds_configs/cpu_hf_trainer.json")
    parser.add_argument("--model", default="demo", help="a lazyzero model preset (tiny, demo, 125m, ...)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def main() -> None:
    options = parse_args()
    lazyzero.patch_deepspeed()  # deepspeed.initialize now reads the "lazyzero" section

    tokenizer = ByteTokenizer()
    problems = generate_problems(2000, seed=0, split="train")
    train_set = TokenizedExamples([format_example(p) for p in problems], tokenizer, seq_len=128)
    model = build_model(options.model, vocab_size=tokenizer.vocab_size, seed=0)

    args = TrainingArguments(output_dir=options.output_dir, deepspeed=options.deepspeed_config,
                             max_steps=options.max_steps, per_device_train_batch_size=4, learning_rate=2e-3,
                             save_steps=options.save_steps, save_total_limit=2, logging_steps=5, seed=0,
                             report_to=[], use_cpu=not torch.cuda.is_available())  # CPU ranks: gloo
    trainer = Trainer(model=model, args=args, train_dataset=train_set, callbacks=[lazyzero.TrainerLogsCallback()])
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
