"""Training texts (generated, or read from local files) and their fixed-length tokenized form.

File formats:
- `.txt`: one example per block of lines; blocks are separated by one or more blank lines, so an
  example may span several lines (as the arithmetic examples do).
- `.jsonl`: one JSON object per non-blank line, with either a "text" field or "question" and
  "answer" fields (GSM8K's layout), the latter formatted like `format_example`.
Every example text ends with exactly one newline.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from torch.utils.data import Dataset

from lazyzero.app.data.arithmetic import Difficulty, format_example, generate_problems
from lazyzero.app.data.tokenizer import Tokenizer

IGNORE_INDEX = -100
_BLANK_LINES = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)*")


def training_texts(
    path: str | None = None, num_examples: int = 2000, seed: int = 0, difficulty: str | Difficulty = "easy"
) -> list[str]:
    """Examples from the file at `path`, or `num_examples` generated train-split arithmetic problems."""
    if path is None:
        return [format_example(p) for p in generate_problems(num_examples, seed, "train", difficulty)]
    return load_texts(path)


def load_texts(path: str) -> list[str]:
    """Examples of a local `.txt` or `.jsonl` file (formats in the module docstring)."""
    file = Path(path)
    if file.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"data file {path} must end in .txt or .jsonl")
    if not file.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    try:
        content = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"data file {path} is not UTF-8 text: {error}") from error
    texts = _texts_of_txt(content) if file.suffix == ".txt" else _texts_of_jsonl(content, path)
    if not texts:
        raise ValueError(f"data file {path} contains no examples")
    return texts


def _texts_of_txt(content: str) -> list[str]:
    content = content.replace("\r\n", "\n")
    return [block.strip("\n") + "\n" for block in _BLANK_LINES.split(content) if block.strip()]


def _texts_of_jsonl(content: str, path: str) -> list[str]:
    texts = []
    for number, line in enumerate(content.splitlines(), start=1):
        if line.strip():
            texts.append(_text_of_record(line, f"{path}:{number}"))
    return texts


def _text_of_record(line: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: malformed JSON: {error.msg}") from error
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "text" in record:
        return _string_field(record, "text", where).rstrip("\n") + "\n"
    if "question" in record and "answer" in record:
        question, answer = _string_field(record, "question", where), _string_field(record, "answer", where)
        return f"Question: {question.strip()}\nAnswer: {answer.strip()}\n"
    raise ValueError(f"{where}: needs a 'text' field or both 'question' and 'answer' fields, found {sorted(record)}")


def _string_field(record: dict, name: str, where: str) -> str:
    value = record[name]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {name!r} must be a string, got {type(value).__name__}")
    return value


class TokenizedExamples(Dataset):
    """Texts tokenized once into fixed-length rows: bos + text + eos, right-padded to `seq_len`.

    `framed` texts (rendered by an instruct model's chat template) carry their own special tokens,
    so none are added. The loss covers the whole text (question included): for short problems the
    question tokens are cheap extra signal and it keeps the dataset independent of any prompt format.
    `labels` equal `input_ids` (the model shifts them) with IGNORE_INDEX on padding; longer texts are
    cut to `seq_len` tokens, with one warning counting them.
    """

    def __init__(self, texts: list[str], tokenizer: Tokenizer, seq_len: int, framed: bool = False):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        rows = [tokenizer.encode(text, add_bos=not framed, add_eos=not framed) for text in texts]
        truncated = sum(len(row) > seq_len for row in rows)
        if truncated:
            warnings.warn(
                f"{truncated} of {len(rows)} examples are longer than seq_len={seq_len} tokens and were truncated"
            )
        self.input_ids = torch.full((len(rows), seq_len), tokenizer.pad_id, dtype=torch.long)
        self.attention_mask = torch.zeros((len(rows), seq_len), dtype=torch.long)
        for index, row in enumerate(rows):
            length = min(len(row), seq_len)
            self.input_ids[index, :length] = torch.tensor(row[:length], dtype=torch.long)
            self.attention_mask[index, :length] = 1
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, IGNORE_INDEX)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[index],
            "labels": self.labels[index],
            "attention_mask": self.attention_mask[index],
        }
