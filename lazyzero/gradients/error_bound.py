"""Per-element error bounds of the quantized collectives (docs/reliability.md row 8), from the scales.

Reduce-scatter. Source rank k sends element i of a block with scale s_k = absmax_k / 127. Let X be
the exact sum over ranks of the values each rank quantized. Then, per element,

    |output - alpha * X| <= alpha * sum_k s_k * (STEP + (W + 2) * 2**-17)

where STEP is the quantization error of one rank in code steps:

* round to nearest: half a step plus the fp32 roundings of x / s and code * s, each at most
  127 * 2**-24 < 2**-17 steps: STEP = 0.5 + 2**-16 (the "quant_round_trip_steps" tolerance of the
  op tests).
* stochastic rounding: floor(x / s + u) is below one step away, plus the same roundings and the
  rounding of x / s + u (< 2**-17 steps): STEP = 1 + 2**-15.

The second term is the fp32 arithmetic of the fused dequantize-sum: W - 1 additions, each rounding
by at most 2**-24 of a partial sum bounded by sum_k 127 s_k (< 2**-17 sum_k s_k per addition), and
the final multiplication by fp32(alpha) (two more roundings: alpha itself unless W is a power of
two, and the product). So blocks that are zero on every rank have bound 0: they must come out
exactly 0. A NaN or Inf scale gives a NaN or Inf bound: such blocks are non-finite, not bounded.

All-reduce adds the requantization of the reduced chunk, with its own scale s': STEP * s' more.
Bounds are computed in fp64 so that they do not round themselves.
"""

from __future__ import annotations

import torch

NEAREST_STEP = 0.5 + 2.0**-16
STOCHASTIC_STEP = 1.0 + 2.0**-15
_SUM_ROUNDING_PER_TERM = 2.0**-17


def quantization_step(stochastic: bool) -> float:
    """Largest error of one quantize-dequantize round trip, in units of the block's scale."""
    return STOCHASTIC_STEP if stochastic else NEAREST_STEP


def _per_element(per_block: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    return per_block.repeat_interleave(block_size)[:numel]


def reduce_scatter_error_bound(
    received_scales: torch.Tensor, block_size: int, numel: int, *, alpha: float, stochastic: bool
) -> torch.Tensor:
    """fp64 [numel] bound on |output - alpha * exact sum| for one owner's reduced segment.

    received_scales: fp32 [W, blocks], the scales every source rank sent for the owner's row.
    """
    world_size = received_scales.shape[0]
    per_term = quantization_step(stochastic) + (world_size + 2) * _SUM_ROUNDING_PER_TERM
    per_block = received_scales.to(torch.float64).sum(dim=0) * (alpha * per_term)
    return _per_element(per_block, block_size, numel)


def requantization_error_bound(
    requantized_scales: torch.Tensor, block_size: int, numel: int, *, stochastic: bool
) -> torch.Tensor:
    """fp64 [numel] bound on the error that requantizing a reduced chunk adds (all-reduce's second
    hop), from the chunk's block scales (fp32 [blocks])."""
    requantization = requantized_scales.to(torch.float64) * quantization_step(stochastic)
    return _per_element(requantization, block_size, numel)
