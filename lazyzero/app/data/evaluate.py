"""Greedy decoding and exact-match accuracy that run unchanged under DeepSpeed ZeRO-3.

Under ZeRO-3 every forward pass gathers parameters collectively, so all ranks must run the same
number of forward passes. Decoding therefore has no data-dependent early exit: every batch runs
exactly `max_new_tokens` forward passes (one prefill, then one per new token with the KV cache),
and all ranks must pass the same number of prompts with the same `batch_size`. Text after an eos
token is dropped from the output, but the forward passes still happen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazyzero.app.data.arithmetic import Problem, extract_answer, format_prompt
from lazyzero.app.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class EvalResult:
    """Exact-match outcome; `samples` holds the first few (prompt, output, expected answer)."""

    correct: int
    total: int
    accuracy: float
    samples: tuple[tuple[str, str, int], ...]


def exact_match_accuracy(
    model,
    tokenizer: Tokenizer,
    problems: list[Problem],
    max_new_tokens: int = 64,
    batch_size: int = 16,
    num_samples: int = 5,
) -> EvalResult:
    """Share of `problems` whose greedy continuation's `#### answer` equals the true answer.

    Prompts are framed by the tokenizer's chat template when it has one (an instruct model).
    """
    prompts = [format_prompt(p, tokenizer.chat) for p in problems]
    outputs = greedy_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                              framed=tokenizer.chat is not None)
    correct = sum(extract_answer(out) == p.answer for out, p in zip(outputs, problems))
    samples = tuple((prompt, out, p.answer) for prompt, out, p in list(zip(prompts, outputs, problems))[:num_samples])
    return EvalResult(correct=correct, total=len(problems), accuracy=correct / max(len(problems), 1), samples=samples)


@torch.no_grad()
def greedy_generate(
    model, tokenizer: Tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int, framed: bool = False
) -> list[str]:
    """Greedy continuations of `prompts` (decoded, cut at eos), in order.

    `model` is an HF causal LM or a DeepSpeed engine wrapping one. It is put in eval mode and its
    previous mode is restored afterwards. Prompts get the tokenizer's bos, except `framed` ones
    (rendered by a chat template, which writes its own special tokens).
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}")
    was_training = model.training
    model.eval()
    try:
        outputs = []
        for start in range(0, len(prompts), batch_size):
            rows = [tokenizer.encode(p, add_bos=not framed) for p in prompts[start : start + batch_size]]
            new_tokens = _generate_batch(model, rows, tokenizer.pad_id, max_new_tokens)
            outputs.extend(_decode_until_eos(tokenizer, row) for row in new_tokens.tolist())
        return outputs
    finally:
        model.train(was_training)


def _generate_batch(model, rows: list[list[int]], pad_id: int, max_new_tokens: int) -> torch.Tensor:
    """[batch, max_new_tokens] greedy tokens after the prompts' ids `rows`, from exactly
    `max_new_tokens` forward passes."""
    device = next(model.parameters()).device
    input_ids, attention_mask = _left_pad(rows, pad_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    # Left padding shifts each row's first real token; positions must count real tokens only, or a
    # padded row would see different rotary / learned positions than the same prompt alone.
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    cache = None
    generated = []
    for _ in range(max_new_tokens):
        # logits_to_keep=1: only the last position's logits are needed; at prefill the full
        # [batch, prompt, vocab] tensor would cost more than the rest of the forward pass for a
        # model with a large vocabulary (SmolLM2: 49152 x 4 bytes per position).
        out = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        next_tokens = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        generated.append(next_tokens)
        cache = out.cache
        input_ids = next_tokens
        attention_mask = torch.cat([attention_mask, torch.ones_like(next_tokens)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
    return torch.cat(generated, dim=-1).cpu()


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[index, width - len(row) :] = 1
    return input_ids, attention_mask


def _decode_until_eos(tokenizer: Tokenizer, tokens: list[int]) -> str:
    if tokenizer.eos_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_id)]
    return tokenizer.decode(tokens)
