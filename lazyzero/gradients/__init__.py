"""Quantized collectives: int8 all-to-all with local fp32 reduction (AGoQ; docs/gradients.md).

`quantized_reduce_scatter` sends each owner its rows as block-wise int8 codes plus fp32 scales and
sums what it receives in fp32; `quantized_all_reduce` follows it with an all-gather of the
requantized int8 chunks. `two_hop_reduce_scatter` reduces inside nodes first, then across them
(`build_node_groups`). `any_nonfinite` lets every rank agree on overflow, and the error bounds
of docs/reliability.md row 8 are computed from the scales (`ReduceScatterResult.error_bound`).
"""

from lazyzero.gradients.error_bound import reduce_scatter_error_bound, requantization_error_bound
from lazyzero.gradients.layout import ChunkLayout, deepspeed_chunk_length
from lazyzero.gradients.nonfinite import any_nonfinite
from lazyzero.gradients.quantized_all_reduce import AllReduceResult, quantized_all_reduce
from lazyzero.gradients.quantized_reduce_scatter import (
    ExchangeBuffers,
    ReduceScatterResult,
    quantized_reduce_scatter,
)
from lazyzero.gradients.two_hop import NodeGroups, TwoHopResult, build_node_groups, group_ranks, two_hop_reduce_scatter

__all__ = [
    "AllReduceResult",
    "ChunkLayout",
    "ExchangeBuffers",
    "NodeGroups",
    "ReduceScatterResult",
    "TwoHopResult",
    "build_node_groups",
    "any_nonfinite",
    "deepspeed_chunk_length",
    "group_ranks",
    "quantized_all_reduce",
    "quantized_reduce_scatter",
    "reduce_scatter_error_bound",
    "requantization_error_bound",
    "two_hop_reduce_scatter",
]
