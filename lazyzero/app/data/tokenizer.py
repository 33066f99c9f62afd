"""Tokenizers behind one small interface: the built-in byte tokenizer, or a local HF tokenizer folder.

The training and evaluation code only needs `vocab_size`, the `pad_id` / `bos_id` / `eos_id` ids,
`encode` and `decode`; both implementations below provide exactly that (`Tokenizer` protocol).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from lazyzero.models.byte_vocabulary import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, NUM_BYTES  # noqa: F401


class Tokenizer(Protocol):
    """What lazyzero's data and evaluation code needs from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then pad (256), bos (257) and eos (258).

    Needs no files and no training, so any text round-trips exactly; the price is longer sequences
    than a subword tokenizer, which is acceptable for the short arithmetic problems of the demo.
    """

    vocab_size = BYTE_VOCAB_SIZE
    pad_id = BYTE_PAD_ID
    bos_id = BYTE_BOS_ID
    eos_id = BYTE_EOS_ID

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by bos / eos."""
        ids = list(text.encode("utf-8"))
        return _frame(ids, self.bos_id if add_bos else None, self.eos_id if add_eos else None)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, skipping special (and out-of-range) ids.

        A model can emit byte sequences that are not valid UTF-8 (for example half of a
        multi-byte character); those decode to U+FFFD instead of raising.
        """
        data = bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A transformers tokenizer adapted to the `Tokenizer` interface.

    Special tokens are added here rather than by the HF tokenizer so that `add_bos` / `add_eos`
    mean the same for every tokenizer. Without a pad token, padding uses eos (the usual convention
    for causal LMs); padded positions are masked out of attention and loss anyway.
    """

    def __init__(self, hf_tokenizer, source: str):
        eos_id = hf_tokenizer.eos_token_id
        pad_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else eos_id
        if eos_id is None:
            raise ValueError(f"tokenizer at {source} defines no eos token; lazyzero needs one to end examples")
        self._tokenizer = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.pad_id = pad_id
        self.bos_id = hf_tokenizer.bos_token_id
        self.eos_id = eos_id

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by bos (when the tokenizer has one) / eos."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return _frame(ids, self.bos_id if add_bos else None, self.eos_id if add_eos else None)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` without special tokens."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def _frame(ids: list[int], bos_id: int | None, eos_id: int | None) -> list[int]:
    prefix = [bos_id] if bos_id is not None else []
    suffix = [eos_id] if eos_id is not None else []
    return prefix + ids + suffix


def load_tokenizer(path: str | None) -> Tokenizer:
    """`ByteTokenizer` for None, else the HF tokenizer saved in the local folder `path` (never downloads)."""
    if path is None:
        return ByteTokenizer()
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {path} does not exist (or is not a folder)")
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a tokenizer folder that transformers can load: {error}") from error
    return HFTokenizer(hf_tokenizer, str(path))
