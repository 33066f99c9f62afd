"""Which bit width each module's saved activations get: the policy of `"lazyzero": {"activations"}`.

AGoQ (docs/activations.md) stores saved activations per layer type: attention keeps 16 bits (its softmax is too
sensitive for 4), MLP, activation-function and norm inputs go to about 4 bits. Modules are
classified by class for the supported families (Llama, Qwen2, Mistral, GPT-2), by name otherwise.

A module's width, first rule that applies wins:
1. its layer is in `recompute_layers`: 16 (the layer's activations are recomputed, not saved, so
   there is nothing to quantize; the recomputation must see exact inputs);
2. the first `overrides` pattern (fnmatch on the module name) that matches it;
3. 16 for attention modules, apart from the tensors below (the planner does not lower attention either);
4. the planner's width for its layer (`ActivationPolicy.with_layer_bits`), else `default_bits`;
   norms get at least `norm_bits` (the residual stream they read has outlier channels: at 4 bits
   the norms gave half the gradient error of the demo model, 0.042 relative, against 0.021 with
   norms at 8 bits).
16 means "keep as saved" (the model's own dtype, fp32 or bf16).

One tensor of an attention module is not attention's own: its input, the output of the norm before
it, which only the q/k/v projections' weight gradients read. It is stored like the norm's stored
input (the layer's norm width, or `attention_input_bits`), which is what lets the norm's output be
rebuilt in backward instead of stored (lazyzero/activations/rewrites.py). q, k, v, the attention's
output and its logsumexp, what the attention's own backward reads, need more care.

q, k and the logsumexp rebuild the softmax, whose exponent turns a small error in a logit into a large
one in a probability. The logsumexp (one value per row) is kept exact. q and k are stored at
`attention_bits` (8) in blocks along tokens within each channel, each block centred
(lazyzero/activations/by_channel.py): in blocks along the hidden dimension, k alone at 8 bits took
SmolLM2's gradient error from 0.0097 to 0.020 and its lowest cosine to 0.990; stored by channel, q and
k together took it to 0.015 and 0.9976 (docs/activations.md). The value, the attention's output and the
output projection's input (a view of that output) are read only by products summed over the head
dimension (dP = dO V^T, the row sums of dO * O, and the output projection's weight gradient), as an
MLP's inputs are, so they are stored at `attention_value_bits` (8) where the layer's own width is below
16. On SmolLM2 that took the gradient error from 0.0073 to 0.0097 and cut the attention's stored bytes
by a third. Without an SDPA call (eager attention) these roles cannot be told apart and the attention's
tensors stay exact.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Mapping

from torch import nn

from lazyzero.activations.config import ActivationsConfig

ModuleKind = Literal["attention", "mlp", "norm", "head", "other"]
KEEP_BITS = 16
ALLOWED_BITS = (4, 8, KEEP_BITS)

# Class names over each module's MRO, so subclasses (e.g. a patched LlamaAttention) match too.
_KINDS_BY_CLASS: dict[str, ModuleKind] = {
    **{f"{family}Attention": "attention" for family in ("Llama", "Qwen2", "Mistral", "GPT2")},
    **{f"{family}MLP": "mlp" for family in ("Llama", "Qwen2", "Mistral", "GPT2")},
    **{f"{family}RMSNorm": "norm" for family in ("Llama", "Qwen2", "Mistral")},
    "LayerNorm": "norm",
    "RMSNorm": "norm",
}
DECODER_LAYER_CLASSES = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer", "GPT2Block"})

# Name fallback for unknown classes, on the last part of the module name.
_KIND_NAME_PATTERNS: tuple[tuple[ModuleKind, tuple[str, ...]], ...] = (
    ("attention", ("*attn*", "*attention*")),
    ("mlp", ("*mlp*", "*ffn*", "*feed_forward*")),
    ("norm", ("*norm*", "ln_*", "ln")),
)
# Building blocks inside attention / MLP (GPT-2's Conv1D is named c_attn): never classified by name,
# so that they inherit the kind and width of the module around them.
_PRIMITIVE_CLASSES = frozenset({"Linear", "Conv1D", "Embedding", "Dropout", "Identity"})

# "model.layers.3.mlp" (Llama, Qwen2, Mistral) and "transformer.h.3.attn" (GPT-2) are in layer 3.
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)(?:\.|$)")
_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h)\.\d+$")


def _class_names(module: nn.Module) -> list[str]:
    return [cls.__name__ for cls in type(module).__mro__]


def classify_module(name: str, module: nn.Module) -> ModuleKind:
    """The kind of `module` (named `name` in its model): by class first, then by name."""
    class_names = _class_names(module)
    for class_name in class_names:
        if class_name in _KINDS_BY_CLASS:
            return _KINDS_BY_CLASS[class_name]
    if _PRIMITIVE_CLASSES.intersection(class_names) or is_decoder_layer(name, module):
        return "other"
    last = name.rsplit(".", 1)[-1]
    for kind, patterns in _KIND_NAME_PATTERNS:
        if any(fnmatch.fnmatchcase(last, pattern) for pattern in patterns):
            return kind
    return "other"


def is_decoder_layer(name: str, module: nn.Module) -> bool:
    """Whether `module` is one whole transformer layer (by class, else named like "model.layers.3")."""
    return bool(DECODER_LAYER_CLASSES.intersection(_class_names(module))) or bool(_LAYER_NAME.search(name))


def layer_index(name: str) -> int | None:
    """The decoder layer a module name belongs to, or None outside the layers (embeddings, final norm)."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def decoder_layers(model: nn.Module) -> dict[int, nn.Module]:
    """The model's whole decoder layers by index (`is_decoder_layer`, with an index in their name)."""
    return {layer_index(name): module for name, module in model.named_modules()
            if is_decoder_layer(name, module) and layer_index(name) is not None}


@dataclass(frozen=True)
class ModuleBits:
    """One module whose forward sets the width of the tensors saved inside it."""

    name: str
    kind: ModuleKind
    layer: int | None
    bits: int
    input_bits: int | None = None
    """Width of the module's own input where narrower than `bits` (attention: see
    `ActivationPolicy.attention_input_bits`); None: `bits`."""
    value_bits: int | None = None
    """Attention only: width of its value, output and output projection's input where narrower than
    `bits` (`ActivationPolicy.attention_value_bits`); None: `bits`."""
    query_key_bits: int | None = None
    """Attention only: width of the query and key its SDPA call saves, stored in blocks along tokens
    (lazyzero/activations/by_channel.py), where narrower than `bits`; None: `bits`."""


@dataclass(frozen=True)
class ActivationPolicy:
    """Bit widths per module from the config, plus the planner's widths per layer."""

    config: ActivationsConfig
    layer_bits: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))
    """Planner's width per layer index; replaces `default_bits` for that layer's non-attention modules."""

    def with_layer_bits(self, layer_bits: Mapping[int, int]) -> ActivationPolicy:
        """A copy of this policy with the planner's width per layer (unlisted layers keep the defaults)."""
        for layer, bits in layer_bits.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise ValueError(f"layer index must be an int >= 0, got {layer!r}")
            if bits not in ALLOWED_BITS:
                raise ValueError(f"layer {layer}: bits must be one of {ALLOWED_BITS}, got {bits!r}")
        return ActivationPolicy(self.config, MappingProxyType(dict(layer_bits)))

    def bits_for(self, name: str, kind: ModuleKind, layer: int | None) -> int:
        """The width of the tensors saved inside module `name` (rules in the module docstring)."""
        if layer is not None and layer in self.config.recompute_layers:
            return KEEP_BITS
        override = self.override_for(name)
        if override is not None:
            return override
        if kind == "attention":
            return KEEP_BITS  # q and k narrower by `attention_bits`, the values by `attention_value_bits`
        return self._norm_width(layer) if kind == "norm" else self._layer_width(layer)

    def _layer_width(self, layer: int | None) -> int:
        return self.layer_bits[layer] if layer is not None and layer in self.layer_bits else self.config.default_bits

    def _norm_width(self, layer: int | None) -> int:
        return max(self._layer_width(layer), self.config.norm_bits)

    def attention_input_bits(self, layer_norm_bits: int, bits: int) -> int | None:
        """The width of an attention module's input, when narrower than the module's `bits`; else None.

        That input is the output of the norm before it, which only the q/k/v projections' weight
        gradients read (the attention's own backward reads q, k, v and its output, kept at `bits`).
        It is stored as precisely as the norm's own stored input, the widest norm width of its layer
        (`layer_norm_bits`), or at `attention_input_bits` when set; where the norm stores only its
        input (`recompute_elementwise`) it is rebuilt from that and costs nothing.
        """
        width = self.config.attention_input_bits
        width = layer_norm_bits if width is None else width
        return width if width < bits else None

    def attention_value_bits(self, layer_width: int, bits: int) -> int | None:
        """The width of attention `bits`'s value, output and output projection's input in a decoder
        layer whose MLP is stored at `layer_width`, when narrower than `bits`, else None:
        `attention_value_bits`, or the layer's width where wider (a layer kept at 16 bits keeps them
        exact, as the planner's 16-bit layers assume)."""
        width = min(bits, max(layer_width, self.config.attention_value_bits))
        return width if width < bits else None

    def override_for(self, name: str) -> int | None:
        for pattern, bits in self.config.overrides.items():
            if fnmatch.fnmatchcase(name, pattern):
                return bits
        return None

    def loss_head_entry(self, name: str) -> ModuleBits:
        """The width of the weight gradient the fused loss head (module `name`) holds for backward, computed
        in forward (lazyzero/activations/loss_head.py; the hidden states' gradient it holds too stays exact).
        A gradient, not an activation, but held as long as one: an `overrides` pattern, else `default_bits`."""
        override = self.override_for(name)
        return ModuleBits(name, "head", None, self.config.default_bits if override is None else override)

    def plan(self, model: nn.Module) -> list[ModuleBits]:
        """The modules of `model` that set a width, in `named_modules` order (parents before children).

        Those are attention, MLP and norm modules, whole decoder layers (whose width covers what
        they save outside their children), and any module an override names. Other modules
        (Linear, activations) inherit the width of the innermost of these around them.
        """
        chosen = []
        for name, module in model.named_modules():
            kind = classify_module(name, module)
            if kind == "other" and not is_decoder_layer(name, module) and self.override_for(name) is None:
                continue
            layer = layer_index(name)
            chosen.append(ModuleBits(name, kind, layer, self.bits_for(name, kind, layer)))
        return self._with_attention_widths(chosen)

    def _with_attention_widths(self, chosen: list[ModuleBits]) -> list[ModuleBits]:
        """`chosen` with each attention module's input width (`attention_input_bits`) and value width
        (`attention_value_bits`, after the layer's MLP width, which an override may set). Outside the
        decoder layers, and in recomputed layers (16 bits throughout), attention keeps both; an
        attention module an override names keeps its values at the override's width."""
        norm_bits: dict[int, int] = {}
        mlp_bits: dict[int, int] = {}
        for entry in chosen:
            widths = {"norm": norm_bits, "mlp": mlp_bits}.get(entry.kind)
            if widths is not None and entry.layer is not None:
                widths[entry.layer] = max(entry.bits, widths.get(entry.layer, 0))
        return [self._attention_widths(entry, norm_bits[entry.layer], mlp_bits.get(entry.layer))
                if entry.kind == "attention" and entry.layer in norm_bits else entry for entry in chosen]

    def _attention_widths(self, entry: ModuleBits, layer_norm_bits: int, layer_mlp_bits: int | None) -> ModuleBits:
        value_bits = query_key_bits = None
        if self.override_for(entry.name) is None and entry.layer not in self.config.recompute_layers:
            layer_width = self._layer_width(entry.layer) if layer_mlp_bits is None else layer_mlp_bits
            value_bits = self.attention_value_bits(layer_width, entry.bits)
            query_key_width = max(layer_width, self.config.attention_bits)  # a 16-bit layer keeps them exact
            query_key_bits = query_key_width if query_key_width < entry.bits else None
        return dataclasses.replace(entry, input_bits=self.attention_input_bits(layer_norm_bits, entry.bits),
                                   value_bits=value_bits, query_key_bits=query_key_bits)
