"""Tokenizers behind one small interface: the built-in byte tokenizer, a local HF tokenizer folder, or
a real model's own tokenizer (from its GGUF file or its transformers folder).

The training and evaluation code only needs `vocab_size`, the `pad_id` / `bos_id` / `eos_id` ids,
`encode`, `decode` and `chat` (an instruct model's chat template, or None); both implementations
below provide exactly that (`Tokenizer` protocol).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from lazyzero.models.byte_vocabulary import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, NUM_BYTES  # noqa: F401
from lazyzero.models.pretrained import PretrainedFiles, pretrained_files


class Tokenizer(Protocol):
    """What lazyzero's data and evaluation code needs from a tokenizer."""

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    chat: ChatTemplate | None

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
    chat = None

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
    for causal LMs); padded positions are masked out of attention and loss anyway. A tokenizer with a
    chat template (an instruct model's) frames prompts and examples with it (`chat`).
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
        self.chat = ChatTemplate(hf_tokenizer) if hf_tokenizer.chat_template else None

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by bos (when the tokenizer has one) / eos."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        return _frame(ids, self.bos_id if add_bos else None, self.eos_id if add_eos else None)

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` without special tokens."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


class ChatTemplate:
    """An instruct model's own chat template, rendered by transformers into text.

    The text carries the template's special tokens (its turn markers, the bos where the template
    writes one), which `HFTokenizer.encode` turns into their ids; so it is encoded with
    add_bos=False and add_eos=False (transformers' chat templating guide: a template that writes bos
    and a tokenizer that adds another give the model a doubled bos it never saw in training).
    """

    def __init__(self, hf_tokenizer):
        self._tokenizer = hf_tokenizer

    def prompt(self, user: str) -> str:
        """The user's turn and the opening of the assistant's: the model's answer follows."""
        return self._render([{"role": "user", "content": user}], add_generation_prompt=True)

    def conversation(self, user: str, assistant: str) -> str:
        """The user's turn and the assistant's whole answer, closed as the template closes a turn."""
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return self._render(messages, add_generation_prompt=False)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)


def _frame(ids: list[int], bos_id: int | None, eos_id: int | None) -> list[int]:
    prefix = [bos_id] if bos_id is not None else []
    suffix = [eos_id] if eos_id is not None else []
    return prefix + ids + suffix


def load_tokenizer(path: str | None, model: str | None = None) -> Tokenizer:
    """The HF tokenizer saved in the local folder `path`; without `path`, the own tokenizer of the
    real model `model` names (a named real model, a GGUF file, a transformers folder holding a
    tokenizer), else `ByteTokenizer`. Never downloads."""
    if path is not None:
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {path} does not exist (or is not a folder)")
        return _hf_tokenizer(PretrainedFiles(folder), path)
    files = pretrained_files(model) if model is not None else None
    if files is None or not files.has_tokenizer():
        return ByteTokenizer()
    return _hf_tokenizer(files, model)


def _hf_tokenizer(files: PretrainedFiles, source: str) -> HFTokenizer:
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(files.folder), gguf_file=files.gguf_file,
                                                     local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{source}: transformers cannot load a tokenizer from it: {error}") from error
    return HFTokenizer(hf_tokenizer, source)
