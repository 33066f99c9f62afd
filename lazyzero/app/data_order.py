"""Deterministic, resumable order of training examples across ranks and steps.

The order depends only on (seed, epoch), so a run resumed at step k reads exactly the examples an
uninterrupted run would (docs/reliability.md, guarantee 3) without saving any sampler state.
"""

from __future__ import annotations

import torch


class StepBatches:
    """Example indices for (step, micro-batch, rank): each global batch is a disjoint slice of one
    seeded permutation per epoch, rank r taking the r-th micro-batch-sized piece of it."""

    def __init__(self, num_examples: int, micro_batch: int, grad_accum: int, rank: int, world: int, seed: int):
        if num_examples < 1:
            raise ValueError("the training set is empty")
        self.n, self.micro, self.accum = num_examples, micro_batch, grad_accum
        self.rank, self.world, self.seed = rank, world, seed
        self._epoch, self._perm = -1, None

    def indices(self, step: int, micro: int) -> list[int]:
        per_micro_global = self.micro * self.world
        start = (step * self.accum + micro) * per_micro_global + self.rank * self.micro
        return [self._at(position) for position in range(start, start + self.micro)]

    def _at(self, position: int) -> int:
        epoch, offset = divmod(position, self.n)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=generator), epoch
        return int(self._perm[offset])
