"""AGoQ's pipeline rule: stages that hold more micro-batches in flight store activations in fewer bits.

Under the 1F1B schedule stage s of S (0-based) runs S - s forwards before its first backward, so it
holds the saved activations of min(S - s, micro_batches) micro-batches at its peak: the first stage
the most, the last stage one. With equal widths the first stage runs out of memory first while the
last stage has room to spare (docs/activations.md: "AGoQ shifts widths between pipeline stages by how many
micro-batches each holds").

The rule implemented here balances the stages' saved-activation memory against the busiest stage.
Memory of a stage is proportional to in_flight * bits (same layers per stage). The busiest stage gets
`base_bits`, which sets the budget max(in_flight) * base_bits; every other stage gets the widest
allowed width whose memory fits that budget. So widths never decrease from the first stage to the
last, no stage needs more memory than the busiest one, and the precision is spent where memory is
cheap. Example, 4 stages, base 4 bits: in flight 4, 3, 2, 1 -> widths 4, 4, 8, 16.
"""

from __future__ import annotations

from typing import Sequence

from lazyzero.activations.policy import ALLOWED_BITS


def one_f_one_b_in_flight(num_stages: int, micro_batches: int | None = None) -> list[int]:
    """Micro-batches whose activations stage s holds at its peak under 1F1B: min(S - s, micro_batches)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if micro_batches is not None and micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    cap = num_stages if micro_batches is None else micro_batches
    return [min(num_stages - stage, cap) for stage in range(num_stages)]


def pipeline_stage_bits(
    in_flight: Sequence[int], base_bits: int = 4, widths: Sequence[int] = ALLOWED_BITS
) -> list[int]:
    """Width per stage: the widest of `widths` with in_flight[s] * width <= max(in_flight) * base_bits."""
    if base_bits not in widths:
        raise ValueError(f"base_bits {base_bits} is not one of the widths {tuple(widths)}")
    if not in_flight or min(in_flight) < 1:
        raise ValueError(f"in_flight must list one or more stages holding >= 1 micro-batch each, got {list(in_flight)}")
    budget = max(in_flight) * base_bits
    return [max(width for width in widths if count * width <= budget) for count in in_flight]
