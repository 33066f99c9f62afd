"""One ZeRO-3 training step of SmolLM2-135M (tied input and output embeddings) on 2 ranks through
lazyzero.initialize, with the fused loss head, checked against the same model run locally (plain
transformers), and written to OUT/rank{r}.json.

Usage (under a launcher): real_model_worker.py OUT
Each rank trains on its own 2 x 32 tokens of chat-framed arithmetic problems.
"""

import json
import os
from pathlib import Path

import deepspeed
import torch

import lazyzero
from lazyzero.app.data import TokenizedExamples, format_example, generate_problems, load_tokenizer
from lazyzero.models import build_model
from lazyzero.testing import destroy_engine, worker_args

MICRO_BATCH, SEQ_LEN, LR = 2, 32, 1e-4

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
    # Every parameter partitioned, the tied embedding included (none persists whole on a rank).
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 10**9,
    # Saved activations kept at 16 bits, so the step stays exact, with the fused loss head (on by
    # default): its gradients of the tied weight go through ZeRO-3's partitioned reduction.
    "lazyzero": {"activations": {"enabled": True, "default_bits": 16, "attention_bits": 16, "norm_bits": 16}},
}


def rank_batch(tokenizer, rank: int) -> dict:
    problems = generate_problems(2 * MICRO_BATCH, seed=0, split="train", difficulty="starter")
    mine = problems[rank * MICRO_BATCH:(rank + 1) * MICRO_BATCH]
    texts = [format_example(p, tokenizer.chat) for p in mine]
    # Cut to SEQ_LEN tokens (a chat-framed problem has about 90): a short step on 2 shared cores.
    examples = TokenizedExamples(texts, tokenizer, SEQ_LEN, framed=True)
    rows = [examples[i] for i in range(MICRO_BATCH)]
    return {k: torch.stack([row[k] for row in rows]) for k in ("input_ids", "labels", "attention_mask")}


def local_reference(model, batch) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Loss and tied-embedding gradient of this rank's batch on the whole model, and the weight itself."""
    loss = model(**batch).loss
    loss.backward()
    embedding = model.get_input_embeddings().weight
    grad = embedding.grad.clone()
    model.zero_grad(set_to_none=True)
    return loss.item(), grad, embedding.detach().clone()


def main() -> None:
    out = Path(worker_args()[0])
    torch.set_num_threads(1)  # two ranks share the test machine's cores
    tokenizer = load_tokenizer(None, model="smollm2-135m")
    model = build_model("smollm2-135m", vocab_size=tokenizer.vocab_size, max_positions=SEQ_LEN)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    # The launcher's RANK: the reference step runs before lazyzero.initialize starts the process group.
    batch = rank_batch(tokenizer, int(os.environ["RANK"]))
    ref_loss, ref_grad, before = local_reference(model, batch)

    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.distributed.all_reduce(ref_grad)
    ref_grad /= world  # ZeRO averages the ranks' gradients
    output = engine(**batch)
    loss = output.loss
    engine.backward(loss)
    embedding = engine.module.get_input_embeddings().weight
    grad = deepspeed.utils.safe_get_full_grad(embedding)
    engine.step()
    loss_after = engine(**batch).loss.item()
    with deepspeed.zero.GatheredParameters([embedding]):
        moved = (embedding.detach() - before).abs().max().item()
    result = {
        "engine": type(engine).__name__, "rank": rank, "tied_before": tied,
        "tied_after": engine.module.lm_head.weight is engine.module.model.embed_tokens.weight,
        "partitioned_numel": sum(p.ds_numel for p in engine.module.parameters()),
        "loss": loss.item(), "reference_loss": ref_loss, "loss_after": loss_after,
        "fused_loss_head": output.logits is None,
        "grad_relative_error": ((grad - ref_grad).norm() / ref_grad.norm()).item(),
        "embedding_max_move": moved, "lr": LR,
    }
    destroy_engine(engine)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
