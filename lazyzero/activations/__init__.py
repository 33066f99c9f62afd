"""Layer-aware quantization of the activations saved for backward (docs/activations.md, AGoQ).

`ActivationPolicy` chooses a width per module (attention 16 bits, the rest 4 by default),
`ActivationPacker` stores saved tensors at that width through saved-tensor hooks and counts the
bytes in an `ActivationAccounting`; `pipeline_stage_bits` is AGoQ's rule for pipeline stages.
`ActivationOffloader` moves the stored forms of chosen layers to host memory or NVMe and reads
them back ahead of their backward (docs/plan.md).
"""

from lazyzero._lazy_names import lazy_names

# Resolved on first use, so that importing `lazyzero.activations.config` (composed by `lazyzero.config`,
# which imports neither torch nor DeepSpeed) does not import the hooks and torch with it.
_HOMES = {
    **dict.fromkeys(('ActivationAccounting', 'SavedBytes'), "accounting"),
    **dict.fromkeys(('ActivationOffloader', 'OffloadedStorage'), "offload"),
    **dict.fromkeys(('AioSettings',), "offload_io"),
    **dict.fromkeys(('ActivationPacker', 'PackedView'), "packing"),
    **dict.fromkeys(('ActivationPolicy', 'ModuleBits', 'classify_module', 'is_decoder_layer', 'layer_index'), "policy"),
    **dict.fromkeys(('one_f_one_b_in_flight', 'pipeline_stage_bits'), "stages"),
}

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = sorted(_HOMES)
