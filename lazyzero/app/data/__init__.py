"""Training data: arithmetic word problems, tokenizers, datasets and exact-match evaluation."""

from lazyzero.app.data.arithmetic import (
    DIFFICULTIES,
    Difficulty,
    Problem,
    extract_answer,
    format_example,
    format_prompt,
    format_solution,
    generate_problems,
)
from lazyzero.app.data.dataset import IGNORE_INDEX, TokenizedExamples, load_texts, training_texts
from lazyzero.app.data.evaluate import EvalResult, exact_match_accuracy, greedy_generate
from lazyzero.app.data.tokenizer import ByteTokenizer, ChatTemplate, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "DIFFICULTIES",
    "IGNORE_INDEX",
    "ByteTokenizer",
    "ChatTemplate",
    "Difficulty",
    "EvalResult",
    "HFTokenizer",
    "Problem",
    "TokenizedExamples",
    "Tokenizer",
    "exact_match_accuracy",
    "extract_answer",
    "format_example",
    "format_prompt",
    "format_solution",
    "generate_problems",
    "greedy_generate",
    "load_texts",
    "load_tokenizer",
    "training_texts",
]
