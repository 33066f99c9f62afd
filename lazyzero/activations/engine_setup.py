"""Saved-activation quantization inside the engine (`"lazyzero": {"activations": {"enabled": true}}`).

`ActivationMemory` holds the packer that the engine's forward runs under, switches torch's
checkpoint on for the `recompute_layers`, turns the packer's byte counts into per-step metrics
and the run report's per-layer table, and ends the activation offload (`close`, at engine destroy).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from lazyzero.activations import ActivationAccounting, ActivationPacker, ActivationPolicy, SavedBytes
from lazyzero.activations.config import ActivationsConfig
from lazyzero.activations.offload_io import AioSettings
from lazyzero.activations.policy import decoder_layers
from lazyzero.patch_point import set_state


class ActivationMemory:
    """The packer around the engine's forward, the recomputed layers, and the byte counts.

    `rank` names this rank's offload folder (default: torch.distributed's rank); `aio_config`:
    DeepSpeed's parsed "aio" section (`engine._config.aio_config`) for the NVMe handle.
    """

    def __init__(self, model: nn.Module, config: ActivationsConfig, *, rank: int | None = None,
                 aio_config: dict | None = None):
        self._recomputed = recompute_layers(model, config.recompute_layers)
        self.packer = ActivationPacker(model, ActivationPolicy(config), ActivationAccounting(), rank=rank,
                                       aio=AioSettings.from_deepspeed(aio_config))
        self.last_step_by_layer: dict[int | None, SavedBytes] = {}

    def step_metrics(self) -> dict:
        """This rank's saved-activation bytes over the forward passes since the last call, then reset.

        `activation_saved_bytes`: what the stored tensors take unpacked (recomputed ones excluded);
        `activation_packed_bytes`: what they take as stored. With `offload_layers`, also
        `activation_offloaded_bytes` (of those, what left the device), `activation_offload_waits` and
        `activation_offload_wait_s` (unpacks that waited for their tensor, and their seconds: the
        exposed transfer time), `activation_offload_write_s` / `activation_offload_read_s` (the NVMe
        worker's seconds from submitting to completing, overlapped with compute),
        `activation_offload_reads_ahead` (reads requested by a later layer's backward, i.e. prefetched)
        and `activation_offload_buffer_peak_bytes` (the most host memory the NVMe staging and read
        buffers took at once: about the largest offloaded layer's stored bytes, while it is read back).
        Raises a background offload error that no unpack raised.
        """
        accounting = self.packer.accounting
        total = accounting.total()
        self.last_step_by_layer = accounting.by_layer()
        metrics = {"activation_saved_bytes": total.before, "activation_packed_bytes": total.after}
        offloader = self.packer.offloader
        if offloader is not None:
            offloader.check()
            io = offloader.take_io_stats()
            metrics.update(activation_offloaded_bytes=total.offloaded,
                           activation_offload_waits=accounting.offload_waits,
                           activation_offload_wait_s=accounting.offload_wait_s,
                           activation_offload_write_s=io.get("write_s", 0.0),
                           activation_offload_read_s=io.get("read_s", 0.0),
                           activation_offload_reads_ahead=io["reads_ahead"],
                           activation_offload_buffer_peak_bytes=io.get("buffer_peak_bytes", 0))
        accounting.reset()
        return metrics

    def report(self) -> dict:
        """Bytes per layer of the last step (key "outside" for embeddings, final norm and loss); with
        `offload_layers`, each row also has `offloaded_bytes`."""
        offloading = self.packer.offloader is not None
        rows = {}
        for layer, cell in sorted(self.last_step_by_layer.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            row = {"saved_bytes": cell.before, "packed_bytes": cell.after}
            if offloading:
                row["offloaded_bytes"] = cell.offloaded
            rows["outside" if layer is None else str(layer)] = row
        return {"activation_bytes_by_layer": rows}

    def close(self) -> None:
        """Undo the setup: hooks unregistered, recomputed layers back to storing, the offload ended
        (files deleted, buffers freed). Engine destroy calls it, and so does a new plan's setup."""
        self.packer.close()
        for layer, before in self._recomputed:
            layer.gradient_checkpointing = before
        self._recomputed = []


def recompute_layers(model: nn.Module, indices: list[int]) -> list[tuple[nn.Module, bool]]:
    """Recompute the decoder layers `indices` in backward (torch's non-reentrant checkpoint); returns
    each layer with its `gradient_checkpointing` before, for undoing.

    transformers' decoder layers (GradientCheckpointingLayer) checkpoint their `forward` inside the
    module hooks, so ZeRO-3's gathers and the packer's scopes run once; the recompute's own saves go
    to the checkpoint's hooks, never to the packer.
    """
    if not indices:
        return []
    layers = decoder_layers(model)
    missing = sorted(set(indices) - set(layers))
    if missing:
        raise ValueError(f"lazyzero.activations.recompute_layers: no decoder layer {missing}; "
                         f"the model has layers 0 to {max(layers, default=-1)}")
    switched = []
    for index in indices:
        layer = layers[index]
        if not hasattr(type(layer), "gradient_checkpointing"):
            raise ValueError(f"lazyzero.activations.recompute_layers: layer {index} ({type(layer).__name__}) is not "
                             "a transformers GradientCheckpointingLayer, which per-layer recomputation relies on")
        switched.append((layer, layer.gradient_checkpointing))
        layer.gradient_checkpointing = True
        set_state(layer, "_gradient_checkpointing_func", functools.partial(checkpoint, use_reentrant=False),
                  owner="lazyzero.activations (recompute_layers)",
                  holder="transformers.modeling_layers:GradientCheckpointingLayer")
    return switched

