"""Which elements of a flat gradient bucket each rank owns after a reduce-scatter.

A `ChunkLayout` assigns every element of a flat bucket of `numel` elements to exactly one owner
rank, as a list of (offset, length) pieces per owner. The quantized collectives send owner r one
row holding its pieces back to back, zero-padded to a common row length, and the owner's result is
those pieces reduced, in the same order.

Three constructors cover the ZeRO stages (DeepSpeed 0.19.8, `deepspeed/runtime/`):

* `even(numel, W)`: one tensor chunked by DeepSpeed's rule (`comm/coalesced_collectives.py`,
  `reduce_scatter_coalesced`, used by stage 3's `__avg_scatter_grads`): chunk = ceil(n / W), and
  rank r owns `flat[r * chunk : r * chunk + chunk]`, i.e. min(chunk, n - r * chunk) elements,
  clamped at 0 (with n < W the last ranks own nothing). Stage 0's all-reduce uses it too.
* `per_tensor(sizes, W)`: a stage-3 bucket of several gradients laid end to end, each chunked by
  that rule on its own, so owner r gets one (possibly empty) piece per tensor, in tensor order, as
  `reduce_scatter_coalesced` returns them.
* `from_ranges(numel, W, ranges)`: arbitrary (owner, offset, length) ranges, as stage 1/2's
  `average_tensor` computes them from the optimizer's partition boundaries (`rank_and_offsets`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

FP32_BYTES = 4

Piece = tuple[int, int]
"""(offset, length) of a run of elements in the flat bucket."""


def deepspeed_chunk_length(numel: int, world_size: int, rank: int) -> int:
    """Elements of a tensor of `numel` that `rank` owns under DeepSpeed's stage-3 chunking."""
    chunk = -(-numel // world_size)
    return max(0, min(chunk, numel - rank * chunk))


@dataclass(frozen=True)
class ChunkLayout:
    """Owner rank of every element of a flat bucket, as (offset, length) pieces per owner."""

    numel: int
    """Elements in the flat bucket."""
    pieces: tuple[tuple[Piece, ...], ...]
    """pieces[r]: the runs owner r reduces, in the order its result holds them (may be empty)."""

    def __post_init__(self) -> None:
        all_pieces = [piece for owned in self.pieces for piece in owned]
        if any(length < 0 for _, length in all_pieces):
            raise ValueError(f"piece lengths must be >= 0, got {all_pieces}")
        # Empty pieces (a rank's share of a tiny tensor) hold nothing, wherever they point.
        runs = sorted(piece for piece in all_pieces if piece[1] > 0)
        position = 0
        for offset, length in runs:
            if offset != position:
                raise ValueError(
                    f"pieces must cover [0, {self.numel}) exactly once; found a run at {offset} "
                    f"(length {length}) where {position} was expected"
                )
            position += length
        if position != self.numel:
            raise ValueError(f"pieces cover {position} elements, the bucket has {self.numel}")

    @classmethod
    def even(cls, numel: int, world_size: int) -> ChunkLayout:
        """One tensor chunked by DeepSpeed's rule: rank r owns [r * chunk, r * chunk + length)."""
        return cls.per_tensor([numel], world_size)

    @classmethod
    def per_tensor(cls, sizes: Sequence[int], world_size: int) -> ChunkLayout:
        """Tensors of `sizes` laid end to end, each chunked by DeepSpeed's rule on its own."""
        pieces: list[list[Piece]] = [[] for _ in range(world_size)]
        start = 0
        for numel in sizes:
            chunk = -(-numel // world_size)
            for rank in range(world_size):
                offset = start + min(rank * chunk, numel)
                pieces[rank].append((offset, deepspeed_chunk_length(numel, world_size, rank)))
            start += numel
        return cls(start, tuple(tuple(owned) for owned in pieces))

    @classmethod
    def from_ranges(
        cls, numel: int, world_size: int, ranges: Iterable[tuple[int, int, int]]
    ) -> ChunkLayout:
        """Arbitrary (owner, offset, length) ranges; each owner keeps them in the order given."""
        pieces: list[list[Piece]] = [[] for _ in range(world_size)]
        for owner, offset, length in ranges:
            if not 0 <= owner < world_size:
                raise ValueError(f"owner {owner} is not a rank of a group of {world_size}")
            pieces[owner].append((offset, length))
        return cls(numel, tuple(tuple(owned) for owned in pieces))

    @property
    def world_size(self) -> int:
        return len(self.pieces)

    def segment_length(self, rank: int) -> int:
        """Elements owner `rank` receives reduced: the sum of its pieces' lengths."""
        return sum(length for _, length in self.pieces[rank])

    def fp32_bytes_sent(self, rank: int) -> int:
        """Bytes `rank` sends in an fp32 reduce-scatter of this layout (ring or direct reduce to
        each owner): every element it does not own, once."""
        return FP32_BYTES * (self.numel - self.segment_length(rank))

    def longest_segment(self) -> int:
        return max(self.segment_length(rank) for rank in range(self.world_size))

    def row_length(self, block_size: int) -> int:
        """Length of every row on the wire: the longest segment rounded up to whole blocks."""
        return -(-self.longest_segment() // block_size) * block_size

    def is_dense(self, block_size: int) -> bool:
        """True when the bucket already is the [W, row] matrix: no copy or padding needed."""
        row = self.row_length(block_size)
        return all(owned == ((rank * row, row),) for rank, owned in enumerate(self.pieces))

    def pack(
        self, flat: torch.Tensor, rows: torch.Tensor, addend: torch.Tensor | None = None
    ) -> None:
        """rows[r] ([W, L]) = owner r's pieces of `flat` (+ `addend`) back to back, then zeros."""
        for rank, owned in enumerate(self.pieces):
            column = 0
            for offset, length in owned:
                source = flat[offset : offset + length]
                destination = rows[rank, column : column + length]
                if addend is None:
                    destination.copy_(source)
                else:
                    torch.add(source, addend[offset : offset + length], out=destination)
                column += length
            rows[rank, column:].zero_()

    def unpack(self, rows: torch.Tensor, flat: torch.Tensor) -> None:
        """Inverse of `pack`, padding dropped: flat[pieces of r] = rows[r][:segment_length(r)]."""
        for rank, owned in enumerate(self.pieces):
            column = 0
            for offset, length in owned:
                flat[offset : offset + length].copy_(rows[rank, column : column + length])
                column += length

    def split(self, rank: int, segment: torch.Tensor) -> list[torch.Tensor]:
        """Views of owner `rank`'s reduced segment, one per piece (stage 3: one per gradient)."""
        lengths = [length for _, length in self.pieces[rank]]
        return list(torch.split(segment, lengths)) if lengths else []
