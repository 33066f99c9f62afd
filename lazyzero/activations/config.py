"""The `lazyzero.activations` config section and its checks.

A capability's section module is on the foundation layer (docs/architecture.md, "The layering rule"):
it imports only `lazyzero.config` helpers, so that `lazyzero.config` composes it into `LazyZeroConfig`
and validating a config imports neither torch nor DeepSpeed.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from lazyzero.config.errors import Problem
from lazyzero.config.fieldtypes import LayerIndices, LayerKey, NonEmptyStr, PowerOfTwo
from lazyzero.config.folders import WRITABLE_DIRECTORY, directory_problems, nvme_folder_problems
from lazyzero.config.section import ConfigSection


class ActivationsConfig(ConfigSection):
    """Block-wise 4/8-bit quantization of the activations saved for backward, chosen per layer."""

    planned_fields = ("enabled", "default_bits", "overrides", "recompute_layers", "offload_layers",
                      "offload_nvme_path")

    enabled: bool = False
    """Quantize saved activations (through saved-tensor hooks) as set below."""

    default_bits: Literal[4, 8, 16] = 8
    """Bits per saved activation for modules no `overrides` pattern matches (MLPs and the rest of each layer); 16
    keeps them unquantized. 4 halves their bytes but, on pretrained LLMs, gives about ten times the gradient error
    of 8 (docs/activations.md)."""

    attention_bits: Literal[8, 16] = 8
    """Bits for the query and key an attention call saves, which rebuild its softmax (too sensitive for 4 bits):
    stored in blocks along tokens within each channel, each block centred, where pretrained models' large key
    channels cost no precision; 16 keeps them exact. The logsumexp, and every tensor of an attention that does not
    call SDPA (eager attention), stay exact (docs/activations.md)."""

    attention_input_bits: Optional[Literal[4, 8, 16]] = None
    """Bits for the attention module's input (the output of the norm before it, read only by the q/k/v projections'
    weight gradients); unset: the layer's norm width, and rebuilt from the norm's stored input at no cost where
    `recompute_elementwise` applies; 16 keeps it exact. Attention's own tensors (q, k, v, output) keep
    `attention_bits` or `attention_value_bits`."""

    attention_value_bits: Literal[8, 16] = 8
    """Fewest bits for the attention's value, its output and the output projection's input, which only sums over the
    head dimension read (q and k, which rebuild the softmax, keep `attention_bits`); a wider layer width applies, so
    a layer kept at 16 bits keeps them exact. 16: kept exact."""

    norm_bits: Literal[4, 8, 16] = 8
    """Fewest bits for tensors saved by norms (their input is the residual stream, whose outlier channels 4-bit
    blocks handle worst); a wider layer width applies."""

    block_size: PowerOfTwo(32, 4096) = 64
    """Elements sharing one scale; smaller blocks follow local magnitudes more closely (at most 256 with
    `keep_outliers`)."""

    keep_outliers: bool = True
    """Store each block's largest-magnitude element exactly (its value in the tensor's dtype and a one-byte index: 3
    bytes per block in bf16) and scale the block by the rest, so that one value thousands of times larger than its
    neighbours, as pretrained LLMs' residual streams carry, costs the others no precision."""

    fused_loss: bool = True
    """Compute a causal LM's cross-entropy loss and its gradients together in forward, a chunk of tokens at a time,
    so that no logits are kept for backward (they are the largest saved tensor of a model with a large vocabulary).
    Applies to transformers causal LMs called with `labels` while autograd records; their output then has no
    `logits`."""

    stochastic_rounding: bool = False
    """Round to a neighbouring code at random (unbiased) instead of to the nearest one."""

    overrides: dict[NonEmptyStr, Literal[4, 8, 16]] = Field(default_factory=dict)
    """Bits per module: module-name glob pattern (fnmatch, e.g. "model.layers.0.*") -> bits; the first matching
    pattern, in the order written, wins."""

    recompute_layers: LayerIndices = Field(default_factory=list)
    """Layers whose activations are recomputed in backward instead of saved."""

    recompute_elementwise: bool = True
    """In quantized modules, store only what cheap elementwise work cannot rebuild: norms keep just their input,
    gated MLPs drop act(gate) and the product (rebuilt in backward, no extra matmul)."""

    offload_layers: dict[LayerKey, Literal["cpu", "nvme"]] = Field(default_factory=dict)
    """Layers whose stored activations (packed, or kept at 16 bits) leave the device right after they are saved and
    are read back ahead of their backward: layer index -> "cpu" (pinned host memory; on a machine without CUDA they
    already are in host memory and stay there) or "nvme" (files under `offload_nvme_path`). Not for layers in
    `recompute_layers`."""

    offload_nvme_path: Optional[NonEmptyStr] = None
    """Existing, writable folder for the files of the "nvme" layers (one sub-folder per rank and process, removed
    when training ends); required when a layer says "nvme"."""

    offload_prefetch_layers: int = Field(1, ge=0)
    """How far ahead backward reads offloaded activations: when layer j's backward starts, the reads of layer j
    (those not asked yet) and of layers j-1 to j-N start. 0: each tensor is read when backward needs it."""


def activations_problems(activations: ActivationsConfig, ds_config: dict) -> list[Problem]:
    """The section against itself where pydantic cannot say it, and against DeepSpeed's activation
    checkpointing."""
    problems = _offload_problems(activations)
    checkpointing = ds_config.get("activation_checkpointing")
    if not activations.enabled or not isinstance(checkpointing, dict):
        return problems
    if checkpointing.get("cpu_checkpointing") is not True:
        return problems
    return problems + [Problem.conflict(
        "activation_checkpointing.cpu_checkpointing", True, "false while lazyzero.activations.enabled is true",
        "lazyzero's hooks already decide where saved activations live, and DeepSpeed's CPU "
        "checkpointing breaks backward on the CPU accelerator")]


# lazyzero.ops.quant_reference.MAX_OUTLIER_BLOCK (an outlier's index in its block is one byte); repeated here
# because validating a config imports neither torch nor deepspeed (tests/config/test_config.py checks both).
MAX_OUTLIER_BLOCK = 256


def _offload_problems(activations: ActivationsConfig) -> list[Problem]:
    """`offload_layers` against the rest of the section, and its NVMe folder (docs/reliability.md, what is tested)."""
    path = "lazyzero.activations"
    offload = activations.offload_layers
    problems = []
    if offload and not activations.enabled:
        problems.append(Problem.bad_value(
            f"{path}.offload_layers", offload,
            f"{{}} while {path}.enabled is false (the offload moves what the activation hooks store)"))
    recomputed = sorted(set(offload) & set(activations.recompute_layers))
    if recomputed:
        problems.append(Problem.bad_value(
            f"{path}.offload_layers", offload,
            f"layers that are not in {path}.recompute_layers (a recomputed layer keeps only its input, for the "
            f"recompute); layers {recomputed} are in both"))
    if "nvme" in offload.values() and activations.offload_nvme_path is None:
        problems.append(Problem.missing(f"{path}.offload_nvme_path",
                                        f"{WRITABLE_DIRECTORY} when a layer of {path}.offload_layers is 'nvme'"))
    if activations.offload_nvme_path is not None:
        problems += (nvme_folder_problems if "nvme" in offload.values() else directory_problems)(
            f"{path}.offload_nvme_path", activations.offload_nvme_path)
    if activations.keep_outliers and activations.block_size > MAX_OUTLIER_BLOCK:
        problems.append(Problem.bad_value(
            f"{path}.block_size", activations.block_size,
            f"at most {MAX_OUTLIER_BLOCK} while {path}.keep_outliers is true (an outlier's index in its block is one "
            "byte); or set keep_outliers to false"))
    return problems
