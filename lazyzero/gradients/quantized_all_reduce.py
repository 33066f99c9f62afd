"""Int8 all-reduce for ZeRO stage 0: quantized reduce-scatter, then an all-gather of int8 codes.

Each rank owns one chunk (DeepSpeed's chunking). After the quantized reduce-scatter it holds its
chunk reduced in fp32; it requantizes that chunk block-wise to int8 and all-gathers codes and
scales, and every rank, the owner included, dequantizes all W chunks. The owner deliberately uses
the dequantized copy, not its fp32 sum, so that all replicas hold bit-identical gradients, as a
full-precision all-reduce would leave them.

Cost of the second hop: the requantization rounds once more, adding at most half a code step of
the reduced chunk's block scale s' (one step with stochastic rounding) to the reduce-scatter bound:
|output - alpha * exact sum| <= alpha * sum_k s_k * (1/2 + ...) + s' * (1/2 + ...)
(`error_bound.requantization_error_bound`). s' = absmax of the reduced block / 127, which is at most
alpha * sum_k absmax_k / 127 = alpha * sum_k s_k: the extra error is no larger than the first.
Error feedback (`residual`) covers the first quantization only; the requantization error is not
carried. With `nodes` the reduce-scatter takes two hops (`two_hop.py`); the all-gather is one
exchange over the whole group either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lazyzero.gradients.error_bound import requantization_error_bound
from lazyzero.gradients.quantized_reduce_scatter import (
    ExchangeBuffers,
    ExchangePlan,
    ReduceScatterResult,
    all_gather_single,
    make_plan,
    quantized_reduce_scatter,
    wire_bytes_per_row_set,
)
from lazyzero.gradients.two_hop import NodeGroups, TwoHopResult, two_hop_reduce_scatter
from lazyzero.ops.quant import DEFAULT_BLOCK_SIZE, BlockQuantized, dequantize_blockwise


@dataclass(frozen=True)
class AllReduceResult:
    """The all-reduced tensor, identical on every rank, and what it cost."""

    output: torch.Tensor
    """fp32, the shape of the input: the sum (or average) over ranks."""
    plan: ExchangePlan
    """The all-gather's plan: the whole group, DeepSpeed's chunking."""
    scattered: ReduceScatterResult | TwoHopResult
    """This rank's chunk after the reduce-scatter, before requantization."""
    requantized_scales: torch.Tensor
    """fp32 [W, blocks per chunk]: the scale of every block of every owner's requantized chunk."""
    wire_bytes: int
    """Bytes this rank sent in both hops."""
    fp32_wire_bytes: int
    """Bytes per rank of an fp32 ring all-reduce (reduce-scatter + all-gather) of the tensor."""

    def owned_slice(self) -> slice:
        """Where this rank's chunk lies in `output`."""
        ((offset, length),) = self.plan.layout.pieces[self.plan.rank]
        return slice(offset, offset + length)

    def owned_error_bound(self) -> torch.Tensor:
        """fp64 bound on |output[owned_slice()] - alpha * exact sum|, per element (a collective
        over the cross-node group with two hops, see `TwoHopResult.error_bound`)."""
        plan = self.plan
        return self.scattered.error_bound() + requantization_error_bound(
            self.requantized_scales[plan.rank], plan.block_size, self.scattered.output.numel(),
            stochastic=plan.stochastic)


def _own_row(scattered: ReduceScatterResult | TwoHopResult, plan: ExchangePlan,
             buffers: ExchangeBuffers) -> torch.Tensor:
    """This rank's reduced chunk zero-padded to the all-gather's row length."""
    if isinstance(scattered, ReduceScatterResult):
        return scattered.row
    row = buffers.take("own_row", plan.row_length, torch.float32, scattered.output.device)
    length = scattered.output.numel()
    row[:length].copy_(scattered.output)
    row[length:].zero_()
    return row


def _gather_chunks(row: torch.Tensor, plan: ExchangePlan, buffers: ExchangeBuffers
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Requantize this rank's reduced row and all-gather every rank's codes and scales."""
    own = plan.quantize(row, phase=1, buffers=buffers)
    device = row.device
    codes = buffers.take("gathered_codes", plan.world_size * plan.row_length, torch.int8, device)
    scales = torch.empty(plan.world_size, plan.blocks_per_row, dtype=torch.float32, device=device)
    pending = [
        all_gather_single(codes, own.codes, group=plan.group, async_op=True),
        all_gather_single(scales.view(-1), own.scales, group=plan.group, async_op=True),
    ]
    for work in pending:
        work.wait()
    return codes, scales


def _dequantize_chunks(
    codes: torch.Tensor, scales: torch.Tensor, plan: ExchangePlan, numel: int
) -> torch.Tensor:
    """All W gathered rows dequantized into one fp32 tensor of `numel`, padding dropped."""
    rows = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    gathered = BlockQuantized(
        codes, scales.view(-1), 8, plan.block_size, rows.shape, torch.float32
    )
    dequantize_blockwise(gathered, out=rows)
    if plan.layout.is_dense(plan.block_size):
        return rows
    output = torch.empty(numel, dtype=torch.float32, device=codes.device)
    plan.layout.unpack(rows.view(plan.world_size, plan.row_length), output)
    return output


def quantized_all_reduce(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stochastic: bool = False,
    seed: int = 0,
    average: bool = True,
    scale: float | None = None,
    residual: torch.Tensor | None = None,
    buffers: ExchangeBuffers | None = None,
    nodes: NodeGroups | None = None,
) -> AllReduceResult:
    """All-reduce `flat` (1-D fp32/bf16/fp16) over `group` with int8 codes on the wire both ways.

    A collective; options as in `quantized_reduce_scatter` (the same `seed` feeds both roundings,
    in distinct streams). Returns the fp32 sum, or average when `average`, or times `scale`,
    identical on all ranks. `nodes` (built for `group`) reduces in two hops.
    """
    buffers = buffers if buffers is not None else ExchangeBuffers()
    plan = make_plan(flat.numel(), group, None, block_size, stochastic, seed, average, scale)
    options = dict(block_size=block_size, stochastic=stochastic, seed=seed, residual=residual, buffers=buffers)
    if nodes is None:
        scattered = quantized_reduce_scatter(flat, group, scale=plan.alpha, **options)
    else:
        scattered = two_hop_reduce_scatter(flat, nodes, layout=plan.layout, scale=plan.alpha, **options)
    if plan.row_length == 0:
        codes = torch.empty(0, dtype=torch.int8, device=flat.device)
        scales = torch.empty(plan.world_size, 0, dtype=torch.float32, device=flat.device)
    else:
        codes, scales = _gather_chunks(_own_row(scattered, plan, buffers), plan, buffers)
    gather_bytes = wire_bytes_per_row_set(plan.world_size, plan.row_length, block_size)
    return AllReduceResult(
        output=_dequantize_chunks(codes, scales, plan, flat.numel()),
        plan=plan,
        scattered=scattered,
        requantized_scales=scales,
        wire_bytes=scattered.wire_bytes + gather_bytes,
        fp32_wire_bytes=2 * scattered.fp32_wire_bytes,
    )
