"""The 8-bit optimizer's NVMe swappers in place of DeepSpeed's while ZeRO-3 builds (docs/optimizer.md):
the one module that imports both, so that neither swapper module imports the other back."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from deepspeed.runtime.zero import stage3

from lazyzero.optimizer.nvme_swap import EightBitStateSwapper
from lazyzero.optimizer.nvme_swap_pipelined import EightBitPipelinedSwapper
from lazyzero.patch_point import swapped


@contextmanager
def eight_bit_state_swapping() -> Iterator[None]:
    """While active, a ZeRO-3 optimizer being built swaps with `EightBitStateSwapper`, or with
    `EightBitPipelinedSwapper` where `pipeline_read` or `pipeline_write` is set.

    `DeepSpeedZeroOptimizer_Stage3._configure_tensor_swapping` picks its swapper class from two
    globals of its module at construction; the swaps (through lazyzero.patch_point) last only for that
    construction.
    """
    owner = "lazyzero.optimizer (NVMe swap)"
    with swapped(stage3, "PartitionedOptimizerSwapper", EightBitStateSwapper, owner=owner), \
            swapped(stage3, "PipelinedOptimizerSwapper", EightBitPipelinedSwapper, owner=owner):
        yield
