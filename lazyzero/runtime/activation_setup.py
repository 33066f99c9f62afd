"""Saved-activation quantization inside the engine (`"lazyzero": {"activations": {"enabled": true}}`).

`ActivationMemory` holds the packer that the engine's forward runs under, switches torch's
checkpoint on for the `recompute_layers`, and turns the packer's byte counts into per-step metrics
and the run report's per-layer table.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from lazyzero.activations import ActivationAccounting, ActivationPacker, ActivationPolicy, SavedBytes
from lazyzero.activations.policy import is_decoder_layer, layer_index
from lazyzero.config.models import ActivationsConfig


class ActivationMemory:
    """The packer around the engine's forward, the recomputed layers, and the byte counts."""

    def __init__(self, model: nn.Module, config: ActivationsConfig):
        recompute_layers(model, config.recompute_layers)
        self.packer = ActivationPacker(model, ActivationPolicy(config), ActivationAccounting())
        self.last_step_by_layer: dict[int | None, SavedBytes] = {}

    def step_metrics(self) -> dict:
        """This rank's saved-activation bytes over the forward passes since the last call, then reset.

        `activation_saved_bytes`: what the stored tensors take unpacked (recomputed ones excluded);
        `activation_packed_bytes`: what they take as stored.
        """
        accounting = self.packer.accounting
        total = accounting.total()
        self.last_step_by_layer = accounting.by_layer()
        accounting.reset()
        return {"activation_saved_bytes": total.before, "activation_packed_bytes": total.after}

    def report(self) -> dict:
        """Bytes per layer of the last step (key "outside" for embeddings, final norm and loss)."""
        rows = {("outside" if layer is None else str(layer)): {"saved_bytes": cell.before, "packed_bytes": cell.after}
                for layer, cell in sorted(self.last_step_by_layer.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))}
        return {"activation_bytes_by_layer": rows}


def recompute_layers(model: nn.Module, indices: list[int]) -> None:
    """Recompute the decoder layers `indices` in backward (torch's non-reentrant checkpoint).

    transformers' decoder layers (GradientCheckpointingLayer) checkpoint their `forward` inside the
    module hooks, so ZeRO-3's gathers and the packer's scopes run once; the recompute's own saves go
    to the checkpoint's hooks, never to the packer.
    """
    if not indices:
        return
    layers = {layer_index(name): module for name, module in model.named_modules()
              if is_decoder_layer(name, module) and layer_index(name) is not None}
    missing = sorted(set(indices) - set(layers))
    if missing:
        raise ValueError(f"lazyzero.activations.recompute_layers: no decoder layer {missing}; "
                         f"the model has layers 0 to {max(layers, default=-1)}")
    for index in indices:
        layer = layers[index]
        if not hasattr(type(layer), "gradient_checkpointing"):
            raise ValueError(f"lazyzero.activations.recompute_layers: layer {index} ({type(layer).__name__}) is not "
                             "a transformers GradientCheckpointingLayer, which per-layer recomputation relies on")
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)

