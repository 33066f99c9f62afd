"""The training loop behind `lazyzero train`: data, model, engine, metrics, checkpoints, evaluation."""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lazyzero.app.data_order import StepBatches
from lazyzero.app.model_build import start_ranks, zero_init_config
from lazyzero.app.run_report import StepLog, peak_memory_bytes, write_run_report
from lazyzero.distributed.cpu_threads import share_cpu_cores
from lazyzero.engine.initialize import initialize

# Largest model whose parameters evaluation gathers whole on every rank (see _whole_params_if_small).
EVAL_GATHER_LIMIT_BYTES = 2 * 2**30
# Decoded eval outputs of rank 0 kept in report.json, before and after training.
EVAL_SAMPLES = 3


class Trainer:
    """One training run on every rank. Rank 0 alone writes logs, reports and the progress bar."""

    def __init__(self, args: argparse.Namespace, ds_config: dict, inputs: "TrainingInputs",
                 started: float | None = None):
        from deepspeed import comm as dist

        self.args = args
        self.tokenizer, self.train_set, self.eval_problems = inputs.tokenizer, inputs.train_set, inputs.eval_problems
        model = inputs.model
        self.engine, _, _, _ = initialize(model=model,
                                          model_parameters=[p for p in model.parameters() if p.requires_grad],
                                          config=ds_config)
        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.batches = StepBatches(len(self.train_set), self.engine.train_micro_batch_size_per_gpu(),
                                   self.engine.gradient_accumulation_steps(), self.rank, self.world, args.seed)
        self.eval_problems = _whole_shards(self.eval_problems, self.world, self.rank)
        self.output_dir = Path(args.output_dir or f"runs/{Path(args.deepspeed_config).stem}-{Path(args.model).name}")
        self.start_step = self._resume() if args.resume else 0
        self.log = self._open_log() if self.rank == 0 else None
        # Seconds from `started` (the entry point's start: tokenizer, data, model load) to a ready
        # engine, then per phase; with eval_samples, what the report says about where time went.
        self.timings = {"setup_time_s": time.perf_counter() - started} if started is not None else {}
        self.eval_samples: dict[str, list[dict]] = {}

    def _resume(self) -> int:
        load_path, client_state = self.engine.load_checkpoint(self.args.save_dir)
        if load_path is None:
            raise SystemExit(f"--resume: no checkpoint could be loaded from {self.args.save_dir}")
        # One saved at a SIGTERM stop has no client state (docs/checkpoint.md, "SIGTERM and preemption");
        # each step of this loop is one optimizer step, so its step is the engine's.
        return int((client_state or {}).get("step", self.engine.global_steps))

    def _open_log(self) -> StepLog:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "metrics.jsonl"
        if self.start_step == 0 and path.exists():
            path.unlink()
        return StepLog(path)

    def run(self) -> None:
        started = time.perf_counter()
        acc_before = self._timed_evaluate("before") if self.start_step == 0 and self.args.eval_before else None
        t0 = time.perf_counter()
        self._train_steps()
        # Lazy checkpoints still being written are committed (or their failure raised) here,
        # before the run reports success.
        self.engine.wait_for_checkpoints()
        self.timings["train_time_s"] = time.perf_counter() - t0
        acc_after = self._timed_evaluate("after")
        if self.rank == 0:
            self._write_report(time.perf_counter() - started, acc_before, acc_after)

    def _timed_evaluate(self, when: str) -> float | None:
        t0 = time.perf_counter()
        accuracy, samples = self.evaluate()
        self.timings[f"eval_time_s_{when}"] = time.perf_counter() - t0
        self.eval_samples[when] = samples
        return accuracy

    def _train_steps(self) -> None:
        from tqdm import tqdm

        steps = range(self.start_step, self.args.max_steps)
        bar = tqdm(steps, desc="train", disable=self.rank != 0, dynamic_ncols=True)
        for step in bar:
            record = self._one_step(step)
            if self.log is not None:
                self.log.append(record)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")

    def _one_step(self, step: int) -> dict:
        self.engine.train()
        t0 = time.perf_counter()
        loss_sum = torch.zeros(2, dtype=torch.float64)
        for micro in range(self.engine.gradient_accumulation_steps()):
            batch = self._batch(step, micro)
            loss = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                               labels=batch["labels"]).loss
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += torch.tensor([loss.item(), float(batch["attention_mask"].sum())], dtype=torch.float64)
        stall = self._maybe_save(step + 1)
        step_time = time.perf_counter() - t0
        loss_total, tokens = self._sum_over_ranks(loss_sum)
        mean_loss = loss_total / (self.world * self.engine.gradient_accumulation_steps())
        return {"step": step + 1, "loss": mean_loss, "tokens_per_s": tokens / step_time,
                "step_time_s": step_time, "peak_mem_bytes": peak_memory_bytes(), "checkpoint_stall_s": stall,
                "lr": self.engine.get_lr()[0] if self.engine.get_lr() else None,
                **self.engine.lazyzero_step_metrics()}

    def _batch(self, step: int, micro: int) -> dict:
        indices = self.batches.indices(step, micro)
        items = [self.train_set[i] for i in indices]
        device = self.engine.device
        return {k: torch.stack([it[k] for it in items]).to(device) for k in ("input_ids", "attention_mask", "labels")}

    def _maybe_save(self, step: int) -> float:
        if not self.args.save_every or step % self.args.save_every:
            return 0.0
        t0 = time.perf_counter()
        self.engine.save_checkpoint(self.args.save_dir, tag=f"step{step}", client_state={"step": step})
        return time.perf_counter() - t0

    def evaluate(self) -> tuple[float | None, list[dict]]:
        """Exact-match accuracy on the eval problems, and this rank's first few decoded samples;
        every rank decodes its share in lockstep."""
        from lazyzero.app.data.evaluate import exact_match_accuracy

        if not self.eval_problems:
            return None, []
        shard = self.eval_problems[self.rank::self.world]
        with self._whole_params_if_small():
            result = exact_match_accuracy(self.engine.module, self.tokenizer, shard,
                                          max_new_tokens=self.args.eval_max_new_tokens, batch_size=len(shard))
            # Decoding still runs ZeRO-3's module hooks: where parameters are released after each
            # use (stage3_max_reuse_distance 0, as the planner sets it) they gather them again, and
            # a prefetch may still be in flight here, which the gather's exit cannot partition.
            self.engine.empty_partition_cache()
        correct, total = self._sum_over_ranks(torch.tensor([result.correct, result.total], dtype=torch.float64))
        samples = [{"output": output, "expected": expected} for _, output, expected in result.samples[:EVAL_SAMPLES]]
        return correct / total, samples

    def _sum_over_ranks(self, values: torch.Tensor) -> list[float]:
        """Element-wise sum over all ranks (on the engine's device: NCCL cannot reduce CPU tensors)."""
        values = values.to(self.engine.device)
        self.dist.all_reduce(values)
        return values.tolist()

    def _whole_params_if_small(self):
        """Under ZeRO-3 every decoding step would all-gather every layer again; gather once instead
        when the whole model is small next to host or device memory (the demo model is 77 MB)."""
        import deepspeed

        if self.engine.zero_optimization_stage() != 3:
            return contextlib.nullcontext()
        params = list(self.engine.module.parameters())
        full_bytes = sum(p.ds_numel * p.element_size() for p in params)
        if full_bytes > EVAL_GATHER_LIMIT_BYTES:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)

    def _write_report(self, wall_s: float, acc_before: float | None, acc_after: float | None) -> None:
        records = self.log.records
        summary = {
            "model": self.args.model, "family": self.args.family or "llama",
            "deepspeed_config": str(self.args.deepspeed_config), "world_size": self.world,
            "zero_stage": self.engine.zero_optimization_stage(),
            "parameters": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                              for p in self.engine.module.parameters()),
            "steps": len(records), "first_loss": records[0]["loss"] if records else None,
            "final_loss": records[-1]["loss"] if records else None,
            "mean_last_10_loss": sum(r["loss"] for r in records[-10:]) / max(1, len(records[-10:])),
            "eval_problems": len(self.eval_problems), "eval_accuracy_before": acc_before,
            "eval_accuracy_after": acc_after,
            "mean_tokens_per_s": sum(r["tokens_per_s"] for r in records) / max(1, len(records)),
            "peak_mem_bytes": max((r["peak_mem_bytes"] for r in records), default=peak_memory_bytes()),
            "memory_kind": "GPU max allocated" if torch.cuda.is_available() else "process peak RSS",
            "wall_time_s": wall_s, **self.timings,
            "step_time_s_median": statistics.median(r["step_time_s"] for r in records) if records else None,
            "eval_samples": self.eval_samples,
            "lazyzero_features": self.engine.lazyzero_config.enabled_features(),
            **self.engine.lazyzero_report(),
        }
        json_path, png_path = write_run_report(self.output_dir, summary, records)
        print(f"lazyzero: report {json_path} and {png_path}; eval accuracy {acc_before} -> {acc_after}")

    def close_log(self) -> None:
        if self.log is not None:
            self.log.close()

    def close(self) -> None:
        self.close_log()
        # The barrier waits for collectives still in flight (ZeRO-3 prefetches) before teardown.
        self.dist.barrier()
        self.engine.destroy()
        torch.distributed.destroy_process_group()


def _whole_shards(problems: list, world: int, rank: int) -> list:
    """The eval problems cut to a multiple of the number of ranks: every rank must decode the same
    number of prompts, in lockstep (ZeRO-3 gathers parameters collectively in every forward)."""
    kept = len(problems) // world * world
    if problems and not kept:
        raise SystemExit(f"--eval-problems {len(problems)}: need at least one per rank ({world} ranks), "
                         "or 0 for no eval")
    if kept < len(problems) and rank == 0:
        print(f"lazyzero: evaluating {kept} of {len(problems)} problems, a multiple of the {world} ranks")
    return problems[:kept]


@dataclass
class TrainingInputs:
    """Everything a run reads from the user's files, loaded before any process group or file exists."""

    tokenizer: object
    train_set: torch.utils.data.Dataset
    eval_problems: list
    model: torch.nn.Module


def load_training_inputs(args: argparse.Namespace, ds_config: dict | None = None) -> TrainingInputs:
    """Tokenizer, data and model; raises ValueError / FileNotFoundError naming the bad file or value.
    With `ds_config`, the model may be built partitioned across the ranks (app/model_build.py), which
    starts torch.distributed first."""
    from lazyzero.app.data.tokenizer import load_tokenizer
    from lazyzero.models.build import build_model

    share_cpu_cores()
    _seed_every_generator(args.seed)
    tokenizer = load_tokenizer(args.tokenizer, model=args.model)
    train_set, eval_problems = _build_datasets(args, tokenizer)
    partition_by = zero_init_config(args, ds_config, tokenizer.vocab_size)
    if partition_by is not None:
        start_ranks(ds_config)
    model = build_model(args.model, family=args.family, vocab_size=tokenizer.vocab_size,
                        seed=args.seed, max_positions=max(args.seq_len, 256), zero_init_config=partition_by)
    # Presets leave special ids unset (family defaults fall outside a byte vocabulary); a saved
    # checkpoint should name the tokens this run actually used.
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_id, tokenizer.eos_id
    model.config.pad_token_id = tokenizer.pad_id
    return TrainingInputs(tokenizer, train_set, eval_problems, model)


def _seed_every_generator(seed: int) -> None:
    """torch's, numpy's and Python's global generators, as they are saved with lazy checkpoints: two
    runs with one --seed, and a resumed one, then hold the same states step by step (docs/reliability.md,
    guarantee 3). Unseeded, numpy and Python's `random` start from OS entropy in every process."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _build_datasets(args: argparse.Namespace, tokenizer):
    """Training examples (generated or from --data) and generated eval problems."""
    from lazyzero.app.data.arithmetic import format_example, generate_problems
    from lazyzero.app.data.dataset import TokenizedExamples, load_texts

    if args.data:
        texts = load_texts(args.data)
    else:
        problems = generate_problems(args.train_examples, seed=args.seed, split="train", difficulty=args.difficulty)
        # An instruct model's chat template frames the generated problems as it frames evaluation.
        texts = [format_example(p, tokenizer.chat) for p in problems]
    eval_problems = (generate_problems(args.eval_problems, seed=args.seed, split="eval", difficulty=args.difficulty)
                     if args.eval_problems else [])
    framed = tokenizer.chat is not None and not args.data
    return TokenizedExamples(texts, tokenizer, args.seq_len, framed=framed), eval_problems
