"""Which stored tensors hold a block that is not finite, decided without making a GPU's host wait.

Where the packer looks (inside attention: SDPA's logsumexp is -inf on fully masked rows), a tensor
with a block holding Inf or NaN must come back exact: quantized, such a block would come back all
NaN. The quantize kernels already mark such blocks on the device: their scale is NaN or +Inf
(lazyzero/ops/quant_reference.py, "Non-finite blocks"; a block whose only non-finite element is
its kept outlier gets a finite scale and comes back exact as it is). Reading that mark back when
the tensor is stored makes the host wait for every queued kernel, once per stored tensor: it more
than doubled an H200's step (docs/activations.md).

So where a read makes the host wait (any device but the CPU), the packer stores a `PendingFinite`:
the quantized form, and the tensor itself alongside. `FiniteChecks.resolve`, called when the
forward pass ends, reads the marks of every pending tensor in one host read: one with a non-finite
block keeps the exact tensor and drops its quantized form, every other one drops the exact tensor.
Both are then stored as the packer stores any form (offloaded where its layer offloads, bytes
counted). An unpack before that (backward inside `with packer:`) resolves them all first. The
price of waiting: the tensors looked at live whole until the forward pass ends. Under SDPA those are
each attention's logsumexp and the rotary tables, a few percent of a layer's activations; where an
override quantizes a whole attention that does not call SDPA (eager), all its tensors.

On the CPU a read makes nobody wait: the packer decides at once (`decides_at_once`), as it always did.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import torch

from lazyzero.activations.policy import KEEP_BITS
from lazyzero.ops.quant import BlockQuantized, dequantize_blockwise

# Device types whose tensors' marks the packer reads when it stores them.
DECIDE_AT_ONCE_ON = ("cpu",)


def decides_at_once(tensor: torch.Tensor) -> bool:
    return tensor.device.type in DECIDE_AT_ONCE_ON


def has_nonfinite_block(packed: BlockQuantized) -> bool:
    """Whether `packed` has a block that is not finite (a host read)."""
    return not bool(torch.isfinite(packed.scales).all())


def nonfinite_block_counts(forms: list[BlockQuantized]) -> list[int]:
    """The number of non-finite blocks of each form, in one host read. A handful of operations for
    them all: the scales in one tensor, the non-finite ones counted by a running sum read at each
    form's end."""
    scales = torch.cat([form.scales for form in forms])
    running = scales.lt(math.inf).logical_not_().cumsum(0)  # a NaN or +Inf scale is not below +Inf
    ends = [end - 1 for end in itertools.accumulate(form.scales.numel() for form in forms)]
    totals = running[torch.tensor(ends, device=scales.device)].tolist()
    return [total - before for total, before in zip(totals, [0, *totals[:-1]])]


class PendingFinite:
    """A stored form that is `packed` or the storage itself (`exact`, its elements flat) once
    `FiniteChecks.resolve` has read whether `packed` has a non-finite block."""

    def __init__(self, checks: FiniteChecks, packed: BlockQuantized, exact: torch.Tensor, settle_args: tuple):
        self._checks = checks
        self.packed: BlockQuantized | None = packed
        self.exact: torch.Tensor | None = exact
        self.settle_args = settle_args
        self.bits = packed.bits
        self.resolved = False
        self.form = None
        """Once resolved: what the packer stored (`packed`, an offloaded copy of it or of the storage, or
        None: `exact` itself)."""

    def resolve_as(self, nonfinite: bool, form) -> None:
        """Now stored as `form`, exact when `nonfinite`: only what `form` needs stays referenced."""
        self.resolved, self.form, self.settle_args, self.packed = True, form, (), None
        if nonfinite:
            self.bits = KEEP_BITS
        if form is not None:
            self.exact = None

    def materialize(self) -> torch.Tensor:
        """The storage's elements, flat, in a buffer of their own."""
        if not self.resolved:
            self._checks.resolve()
        if self.form is None:
            return self.exact.clone()
        if isinstance(self.form, BlockQuantized):
            return dequantize_blockwise(self.form).reshape(-1)
        return self.form.materialize()


class FiniteChecks:
    """The packer's pending tensors; `settle(pending, nonfinite)` stores one once its verdict is
    known and returns what it stored (see `PendingFinite.form`)."""

    def __init__(self, settle: Callable[[PendingFinite, bool], object]):
        self._settle = settle
        self._pending: list[PendingFinite] = []

    def add(self, packed: BlockQuantized, exact: torch.Tensor, *settle_args) -> PendingFinite:
        pending = PendingFinite(self, packed, exact, settle_args)
        self._pending.append(pending)
        return pending

    def resolve(self) -> None:
        """Decide every pending tensor (one host read for them all)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        for form, count in zip(pending, nonfinite_block_counts([form.packed for form in pending])):
            form.resolve_as(count > 0, self._settle(form, count > 0))
