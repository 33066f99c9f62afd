"""Quantized collectives: int8 all-to-all with local fp32 reduction (AGoQ; docs/gradients.md).

`quantized_reduce_scatter` sends each owner its rows as block-wise int8 codes plus fp32 scales and
sums what it receives in fp32; `quantized_all_reduce` follows it with an all-gather of the
requantized int8 chunks. `two_hop_reduce_scatter` reduces inside nodes first, then across them
(`build_node_groups`). `any_nonfinite` lets every rank agree on overflow, and the error bounds
of docs/reliability.md row 8 are computed from the scales (`ReduceScatterResult.error_bound`).
"""

import sys
import types

from lazyzero._lazy_names import lazy_names

# Resolved on first use, so that importing `lazyzero.gradients.config` (composed by `lazyzero.config`,
# which imports neither torch nor DeepSpeed) does not import the collectives and torch with it.
_HOMES = {
    "reduce_scatter_error_bound": "error_bound", "requantization_error_bound": "error_bound",
    "ChunkLayout": "layout", "deepspeed_chunk_length": "layout",
    "any_nonfinite": "nonfinite",
    "AllReduceResult": "quantized_all_reduce", "quantized_all_reduce": "quantized_all_reduce",
    "ExchangeBuffers": "quantized_reduce_scatter", "ReduceScatterResult": "quantized_reduce_scatter",
    "quantized_reduce_scatter": "quantized_reduce_scatter",
    "NodeGroups": "two_hop", "TwoHopResult": "two_hop", "build_node_groups": "two_hop", "group_ranks": "two_hop",
    "two_hop_reduce_scatter": "two_hop",
}

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = sorted(_HOMES)


class _Package(types.ModuleType):
    """The import system binds each submodule on its package once it is imported; two of them share
    their name with their function (`quantized_all_reduce`, `quantized_reduce_scatter`), and on the
    package that name means the function, as when this module imported them itself."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _HOMES.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

