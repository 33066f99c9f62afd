"""Layer-aware quantization of the activations saved for backward (docs/activations.md, AGoQ).

`ActivationPolicy` chooses a width per module (attention 16 bits, the rest 4 by default),
`ActivationPacker` stores saved tensors at that width through saved-tensor hooks and counts the
bytes in an `ActivationAccounting`; `pipeline_stage_bits` is AGoQ's rule for pipeline stages.
`ActivationOffloader` moves the stored forms of chosen layers to host memory or NVMe and reads
them back ahead of their backward (docs/plan.md).
"""

from lazyzero.activations.accounting import ActivationAccounting, SavedBytes
from lazyzero.activations.offload import ActivationOffloader, OffloadedStorage
from lazyzero.activations.offload_io import AioSettings
from lazyzero.activations.packing import ActivationPacker, PackedView
from lazyzero.activations.policy import (
    ActivationPolicy,
    ModuleBits,
    classify_module,
    is_decoder_layer,
    layer_index,
)
from lazyzero.activations.stages import one_f_one_b_in_flight, pipeline_stage_bits

__all__ = [
    "ActivationAccounting",
    "ActivationOffloader",
    "ActivationPacker",
    "ActivationPolicy",
    "AioSettings",
    "ModuleBits",
    "OffloadedStorage",
    "PackedView",
    "SavedBytes",
    "classify_module",
    "is_decoder_layer",
    "layer_index",
    "one_f_one_b_in_flight",
    "pipeline_stage_bits",
]
