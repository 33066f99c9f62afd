"""Layer-aware quantization of the activations saved for backward (issue 6, AGoQ).

`ActivationPolicy` chooses a width per module (attention 16 bits, the rest 4 by default),
`ActivationPacker` stores saved tensors at that width through saved-tensor hooks and counts the
bytes in an `ActivationAccounting`; `pipeline_stage_bits` is AGoQ's rule for pipeline stages.
"""

from lazyzero.activations.accounting import ActivationAccounting, SavedBytes
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
    "ActivationPacker",
    "ActivationPolicy",
    "ModuleBits",
    "PackedView",
    "SavedBytes",
    "classify_module",
    "is_decoder_layer",
    "layer_index",
    "one_f_one_b_in_flight",
    "pipeline_stage_bits",
]
