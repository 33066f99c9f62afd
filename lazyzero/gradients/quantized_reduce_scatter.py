"""Int8 reduce-scatter: quantize per owner, exchange by all-to-all, dequantize and sum in fp32.

Algorithm (AGoQ; docs/gradients.md). A ring reduce-scatter in low precision adds partial sums hop by hop in
the wire format: every hop rounds again and int8 or fp16 partial sums overflow. Instead, each rank

1. arranges its bucket as W rows, row r holding what owner r reduces (`ChunkLayout`; by default
   DeepSpeed's chunking), each row zero-padded to the same length, a multiple of the block size;
2. quantizes the rows block-wise to int8 codes with one fp32 scale per block (the native op,
   writing into reusable buffers);
3. sends row r to rank r with two `all_to_all_single` calls (codes, scales), so every element
   crosses the wire exactly once, as one int8 code plus 1/block_size of a scale;
4. dequantizes the W rows it received and sums them in fp32 with the fused `dequantize_sum_int8`,
   multiplied by 1/W when averaging.

Each source rank's value is rounded once, so the error of a sum is at most the sum over ranks of
half a code step of that rank's block (`error_bound`), and nothing is ever accumulated in int8.
Padding is zeros quantized to code 0: it costs int8 bytes, never full-precision ones, and sums to
exactly 0. A NaN or Inf gives its block a NaN or Inf scale, which the fused sum keeps non-finite
in the owner's output; `any_nonfinite` makes every rank agree on it.

Error feedback (optional): with `residual`, the rank quantizes x = input + residual and writes
x - dequantize(quantize(x)) back into `residual`, so what is rounded away this step is sent in a
later one. A non-finite residual entry is reset to 0: the overflowed step is skipped, and carrying
NaN forward would poison every later step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lazyzero.gradients.error_bound import reduce_scatter_error_bound
from lazyzero.gradients.layout import FP32_BYTES, ChunkLayout
from lazyzero.ops.quant import (
    DEFAULT_BLOCK_SIZE,
    BlockQuantized,
    dequantize_blockwise,
    dequantize_sum_int8,
    quantize_blockwise,
)

SCALE_BYTES = FP32_BYTES
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; torch >= 2.4 is
# supported, so take whichever this torch has.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_SEED_MODULUS = 2**63


class ExchangeBuffers:
    """Scratch tensors reused across calls (one object per bucket stream): send and receive codes
    and scales, the packed fp32 rows. Grown when a call needs more; never shrunk."""

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous 1-D tensor of `numel` elements, valid until the next `take` of `name`."""
        tensor = self._tensors.get(name)
        fits = tensor is not None and tensor.numel() >= numel
        if not fits or tensor.dtype != dtype or tensor.device != device:
            tensor = torch.empty(numel, dtype=dtype, device=device)
            self._tensors[name] = tensor
        return tensor[:numel]


def stream_seed(seed: int, rank: int, world_size: int, phase: int) -> int:
    """Seed of one rank's stochastic rounding in one phase (0: scatter, 1: all-gather requantize).

    Distinct per rank and phase, so that ranks do not round with the same random numbers (their
    errors would add up instead of averaging out).
    """
    return ((seed * world_size + rank) * 2 + phase) % _SEED_MODULUS


def wire_bytes_per_row_set(world_size: int, row_length: int, block_size: int) -> int:
    """Bytes one rank sends when it ships one row to each of the W - 1 other ranks."""
    return (world_size - 1) * (row_length + SCALE_BYTES * (row_length // block_size))


def _check_inputs(
    flat: torch.Tensor, residual: torch.Tensor | None, layout: ChunkLayout, world_size: int
) -> None:
    if flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D tensor, got shape {list(flat.shape)}")
    if layout.numel != flat.numel() or layout.world_size != world_size:
        raise ValueError(
            f"layout is for {layout.numel} elements on {layout.world_size} ranks; the call has "
            f"{flat.numel()} elements on {world_size} ranks"
        )
    if residual is not None and (
        residual.shape != flat.shape
        or residual.dtype != torch.float32
        or residual.device != flat.device
    ):
        raise ValueError(
            f"residual must be float32 of shape {list(flat.shape)} on {flat.device}, got "
            f"{residual.dtype} {list(residual.shape)} on {residual.device}"
        )


@dataclass(frozen=True)
class ExchangePlan:
    """What every rank agrees on before an exchange: group, ownership, row shape, rounding."""

    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    layout: ChunkLayout
    block_size: int
    stochastic: bool
    seed: int
    alpha: float

    @property
    def row_length(self) -> int:
        return self.layout.row_length(self.block_size)

    @property
    def blocks_per_row(self) -> int:
        return self.row_length // self.block_size

    def quantize(
        self, values: torch.Tensor, phase: int, buffers: ExchangeBuffers
    ) -> BlockQuantized:
        """Block-wise int8 of `values` into the buffers `phase` owns, with this rank's seed."""
        codes = buffers.take(f"codes{phase}", values.numel(), torch.int8, values.device)
        scales = buffers.take(f"scales{phase}", values.numel() // self.block_size, torch.float32,
                              values.device)
        seed = stream_seed(self.seed, self.rank, self.world_size, phase)
        return quantize_blockwise(values, 8, self.block_size, self.stochastic, seed,
                                  out=(codes, scales))


def make_plan(
    numel: int,
    group: dist.ProcessGroup | None,
    layout: ChunkLayout | None,
    block_size: int,
    stochastic: bool,
    seed: int,
    average: bool,
    scale: float | None = None,
) -> ExchangePlan:
    """The plan of one collective call; `layout` defaults to DeepSpeed's chunking; the sum is
    multiplied by `scale`, or by 1/W when `average` and 1 otherwise."""
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    world_size = dist.get_world_size(group)
    return ExchangePlan(
        group=group,
        world_size=world_size,
        rank=dist.get_rank(group),
        layout=layout if layout is not None else ChunkLayout.even(numel, world_size),
        block_size=block_size,
        stochastic=stochastic,
        seed=seed,
        alpha=scale if scale is not None else (1.0 / world_size if average else 1.0),
    )


@dataclass(frozen=True)
class ReduceScatterResult:
    """This rank's reduced segment and what it cost."""

    row: torch.Tensor
    """fp32 [row_length]: the reduced row; zeros after this rank's segment (padding sums to 0)."""
    received_scales: torch.Tensor
    """fp32 [W, row_length / block_size]: the scales each source rank sent for this row."""
    plan: ExchangePlan
    wire_bytes: int
    """Bytes this rank sent: codes and scales of its W - 1 rows for other ranks (its own row never
    leaves the process)."""
    fp32_wire_bytes: int
    """Bytes an fp32 reduce-scatter of the same layout sends per rank (W - 1 unpadded chunks)."""

    @property
    def output(self) -> torch.Tensor:
        """fp32: the pieces this rank owns, reduced, back to back (unpadded)."""
        return self.row[: self.plan.layout.segment_length(self.plan.rank)]

    def pieces(self) -> list[torch.Tensor]:
        """`output` split per piece of the layout (stage 3: one chunk per gradient)."""
        return self.plan.layout.split(self.plan.rank, self.output)

    def error_bound(self) -> torch.Tensor:
        """fp64 bound on |output - alpha * exact sum of the quantized inputs|, per element."""
        return reduce_scatter_error_bound(
            self.received_scales,
            self.plan.block_size,
            self.output.numel(),
            alpha=self.plan.alpha,
            stochastic=self.plan.stochastic,
        )


def _send_rows(
    flat: torch.Tensor, residual: torch.Tensor | None, plan: ExchangePlan, buffers: ExchangeBuffers
) -> torch.Tensor:
    """The [W * row_length] values to quantize: `flat` itself when it already has that layout,
    else owner rows packed into an fp32 buffer (with the residual added)."""
    if residual is None and flat.is_contiguous() and plan.layout.is_dense(plan.block_size):
        return flat
    rows = buffers.take("send_values", plan.world_size * plan.row_length, torch.float32,
                        flat.device)
    plan.layout.pack(flat, rows.view(plan.world_size, plan.row_length), addend=residual)
    return rows


def _store_residual(
    sent: BlockQuantized,
    quantized_values: torch.Tensor,
    layout: ChunkLayout,
    residual: torch.Tensor,
    buffers: ExchangeBuffers,
) -> None:
    """residual = x - dequantize(quantize(x)) for the packed x; non-finite entries become 0."""
    restored = buffers.take("restored", quantized_values.numel(), torch.float32, residual.device)
    dequantize_blockwise(sent, out=restored)
    quantized_values.sub_(restored)
    layout.unpack(quantized_values.view(layout.world_size, -1), residual)
    residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _exchange(
    flat: torch.Tensor,
    residual: torch.Tensor | None,
    plan: ExchangePlan,
    buffers: ExchangeBuffers,
    row: torch.Tensor,
    received_scales: torch.Tensor,
) -> None:
    """Quantize, all-to-all and dequantize-sum into `row`; the received scales too."""
    values = _send_rows(flat, residual, plan, buffers)
    sent = plan.quantize(values, phase=0, buffers=buffers)
    received_codes = buffers.take("received_codes", sent.codes.numel(), torch.int8, flat.device)
    # Asynchronous, so that the residual is computed while the rows travel.
    pending = [
        dist.all_to_all_single(received_codes, sent.codes, group=plan.group, async_op=True),
        dist.all_to_all_single(received_scales.view(-1), sent.scales, group=plan.group,
                               async_op=True),
    ]
    if residual is not None:
        _store_residual(sent, values, plan.layout, residual, buffers)
    for work in pending:
        work.wait()
    codes = received_codes.view(plan.world_size, plan.row_length)
    dequantize_sum_int8(codes, received_scales, plan.block_size, plan.alpha, out=row)


def quantized_reduce_scatter(
    flat: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stochastic: bool = False,
    seed: int = 0,
    average: bool = True,
    scale: float | None = None,
    residual: torch.Tensor | None = None,
    layout: ChunkLayout | None = None,
    buffers: ExchangeBuffers | None = None,
) -> ReduceScatterResult:
    """Reduce-scatter `flat` (1-D fp32/bf16/fp16) over `group` with int8 codes on the wire.

    A collective: every rank calls it with the same size, layout and options. `layout` says which
    elements each rank owns (default: DeepSpeed's chunking, `ChunkLayout.even`). The result holds
    this rank's reduced elements in fp32, averaged over the group when `average`, or multiplied by
    `scale` when given (in the fused sum: no second pass over the output). `seed` makes
    stochastic rounding reproducible (each rank derives its own stream from it). `residual`
    (fp32, shape of `flat`) turns on error feedback and is updated in place. `buffers` keeps the
    scratch tensors between calls.
    """
    plan = make_plan(flat.numel(), group, layout, block_size, stochastic, seed, average, scale)
    _check_inputs(flat, residual, plan.layout, plan.world_size)
    row = torch.empty(plan.row_length, dtype=torch.float32, device=flat.device)
    received_scales = torch.empty(
        plan.world_size, plan.blocks_per_row, dtype=torch.float32, device=flat.device
    )
    # An empty bucket is empty on every rank (same layout): no rank calls the collective.
    if plan.row_length:
        _exchange(flat, residual, plan, buffers or ExchangeBuffers(), row, received_scales)
    return ReduceScatterResult(
        row=row,
        received_scales=received_scales,
        plan=plan,
        wire_bytes=wire_bytes_per_row_set(plan.world_size, plan.row_length, block_size),
        fp32_wire_bytes=(plan.world_size - 1) * FP32_BYTES * plan.layout.longest_segment(),
    )
