"""Two-hop int8 reduce-scatter for several nodes: inside each node first, then across nodes.

W = N nodes x L ranks per node; group rank g = node * L + local (the block placement of the
deepspeed launcher and of `mpirun --map-by slot`). Owner g's elements are reduced in two exchanges,
both int8 all-to-alls with fp32 local sums (`quantized_reduce_scatter`):

1. inside the node (group of L): local rank l receives, summed over the node, the elements of
   every owner with local rank l, one per node (`node_layouts`, the intra layout);
2. across nodes (group of N ranks sharing local rank l): each node's partial sums of owner
   n * L + l go to node n, which adds the N partials.

A rank sends (L-1)/L of its bucket inside its node and (N-1)/(N L) across nodes, against
(W-1)/W across everything in one hop: the slow links between nodes carry N times fewer bytes than
in one flat exchange, and int8 ones. The cost is a second rounding: each node's partial is
requantized before crossing. The error bound adds up accordingly (`TwoHopResult.error_bound`),
and error feedback (`residual`) covers the first rounding, the one of the rank's own gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lazyzero.gradients.layout import ChunkLayout
from lazyzero.gradients.quantized_reduce_scatter import (
    ExchangeBuffers,
    ReduceScatterResult,
    all_gather_single,
    quantized_reduce_scatter,
)
from lazyzero.ops.quant import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in a `nodes x ranks_per_node` layout of a process group, and the two
    subgroups the exchanges run in."""

    group: dist.ProcessGroup | None
    """The whole group (None: the default group)."""
    ranks_per_node: int
    nodes: int
    node: int
    local_rank: int
    intra: dist.ProcessGroup
    """The ranks of this node."""
    cross: dist.ProcessGroup
    """One rank per node: those with this rank's local rank."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of `group` in group-rank order (None: the default group)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def build_node_groups(group: dist.ProcessGroup | None, ranks_per_node: int) -> NodeGroups:
    """Create the intra-node and cross-node subgroups of `group`.

    A collective over the default group: every process calls it with the same arguments (torch
    requires every process to take part in creating every subgroup).
    """
    ranks = group_ranks(group)
    if ranks_per_node < 1 or len(ranks) % ranks_per_node:
        raise ValueError(f"ranks_per_node {ranks_per_node} does not divide the group of {len(ranks)} ranks")
    nodes = len(ranks) // ranks_per_node
    index = dist.get_rank(group)
    node, local_rank = divmod(index, ranks_per_node)
    intra = cross = None
    for n in range(nodes):
        subgroup = dist.new_group(ranks[n * ranks_per_node : (n + 1) * ranks_per_node])
        intra = subgroup if n == node else intra
    for local in range(ranks_per_node):
        subgroup = dist.new_group(ranks[local::ranks_per_node])
        cross = subgroup if local == local_rank else cross
    return NodeGroups(group, ranks_per_node, nodes, node, local_rank, intra, cross)


def node_layouts(layout: ChunkLayout, ranks_per_node: int, local_rank: int) -> tuple[ChunkLayout, ChunkLayout]:
    """(intra, cross) layouts of the two hops for a rank with `local_rank`.

    intra (L owners, over the bucket): local owner l gets the pieces of owners l, L + l, 2L + l, ...
    in that order. cross (N owners, over what the first hop gave this rank): node n gets the run
    of owner n * L + local_rank.
    """
    nodes = layout.world_size // ranks_per_node
    intra = ChunkLayout(layout.numel, tuple(
        tuple(piece for node in range(nodes) for piece in layout.pieces[node * ranks_per_node + local])
        for local in range(ranks_per_node)))
    lengths = [layout.segment_length(node * ranks_per_node + local_rank) for node in range(nodes)]
    starts = [sum(lengths[:node]) for node in range(nodes)]
    cross = ChunkLayout(sum(lengths), tuple(((start, length),) for start, length in zip(starts, lengths)))
    return intra, cross


@dataclass(frozen=True)
class TwoHopResult:
    """This rank's reduced segment after both hops, and what it cost."""

    nodes: NodeGroups
    layout: ChunkLayout
    inside: ReduceScatterResult
    """The first hop: this rank's share of the node's partial sums."""
    across: ReduceScatterResult
    """The second hop: the partials of every node added, times the scale."""

    @property
    def output(self) -> torch.Tensor:
        """fp32: the pieces of `layout` this rank owns, reduced, back to back."""
        return self.across.output

    @property
    def rank(self) -> int:
        return self.nodes.node * self.nodes.ranks_per_node + self.nodes.local_rank

    def pieces(self) -> list[torch.Tensor]:
        return self.layout.split(self.rank, self.output)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sent in both hops."""
        return self.inside.wire_bytes + self.across.wire_bytes

    @property
    def fp32_wire_bytes(self) -> int:
        """Bytes a one-hop fp32 reduce-scatter of `layout` sends from this rank."""
        return self.layout.fp32_bytes_sent(self.rank)

    def error_bound(self) -> torch.Tensor:
        """fp64 bound on |output - scale * exact sum of every rank's quantized values|, per element.

        The second hop's bound, plus scale times the first-hop bound of each node's partial of
        these elements. Those first-hop bounds live on the other nodes: this is a collective over
        the cross-node group (for tests and diagnostics, not for training).
        """
        first = self.inside.error_bound()
        gathered = torch.empty(self.nodes.nodes, first.numel(), dtype=torch.float64, device=first.device)
        if first.numel():
            all_gather_single(gathered.view(-1), first.contiguous(), group=self.nodes.cross)
        ((start, length),) = self.across.plan.layout.pieces[self.nodes.node]
        partial_errors = gathered[:, start : start + length].sum(dim=0)
        return self.across.error_bound() + self.across.plan.alpha * partial_errors


def two_hop_reduce_scatter(
    flat: torch.Tensor,
    nodes: NodeGroups,
    *,
    layout: ChunkLayout | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stochastic: bool = False,
    seed: int = 0,
    scale: float = 1.0,
    residual: torch.Tensor | None = None,
    buffers: ExchangeBuffers | None = None,
) -> TwoHopResult:
    """Reduce-scatter `flat` over `nodes.group` in two int8 hops; the result is what the one-hop
    `quantized_reduce_scatter` with the same `layout` gives, up to the second rounding.

    A collective over the group. `scale` multiplies the sum (1/W averages); `residual` turns on
    error feedback for the first hop. Each hop rounds with its own seed stream.
    """
    layout = layout if layout is not None else ChunkLayout.even(flat.numel(), nodes.world_size)
    if layout.world_size != nodes.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks; the node layout has {nodes.world_size}")
    buffers = buffers if buffers is not None else ExchangeBuffers()
    intra, cross = node_layouts(layout, nodes.ranks_per_node, nodes.local_rank)
    inside = quantized_reduce_scatter(
        flat, nodes.intra, block_size=block_size, stochastic=stochastic, seed=2 * seed, scale=1.0,
        residual=residual, layout=intra, buffers=buffers)
    across = quantized_reduce_scatter(
        inside.output, nodes.cross, block_size=block_size, stochastic=stochastic, seed=2 * seed + 1,
        scale=scale, layout=cross, buffers=buffers)
    return TwoHopResult(nodes, layout, inside, across)
