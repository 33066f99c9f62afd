"""What autograd holds for a saved tensor once the packer has stored it (lazyzero/activations/packing.py).

A `PackedView` is the tensor's geometry inside its storage, and the storage's stored form: block-wise
quantized (`BlockQuantized`), a `DerivedStorage` recipe that rebuilds it from other stored tensors,
or either of the first moved off the device (`OffloadedStorage`, offload.py). `unpack_saved` turns
any of them (or a tensor kept as saved) back into a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from lazyzero.activations.policy import KEEP_BITS
from lazyzero.ops.quant import BlockQuantized, dequantize_blockwise


@dataclass(frozen=True)
class DerivedStorage:
    """A contiguous storage that backward recomputes as `fn(*sources)` instead of storing it."""

    fn: Callable[..., torch.Tensor]
    sources: tuple  # PackedView (stored packed) or torch.Tensor (kept as saved)
    fn_in_place: Callable[..., torch.Tensor] | None = None
    """`fn` writing into its first argument: used when that one is rebuilt for this call (not a kept
    tensor), so that backward holds one buffer less at its peak."""
    _for_autograd: list = field(default_factory=list, compare=False, repr=False)

    @property
    def bits(self) -> int:
        """The narrowest width among the sources: the precision the recipe rebuilds at."""
        return min((_stored_bits(source) for source in self.sources), default=KEEP_BITS)

    def materialize_for_autograd(self) -> torch.Tensor:
        """`materialize()` once for every autograd node that reads this storage (the q, k and v
        projections all read the attention's input); autograd never writes into a saved tensor. The
        result lives as long as the recipe, whose last reference goes with the last of those nodes,
        and they run one after another in backward."""
        if not self._for_autograd:
            self._for_autograd.append(self.materialize())
        return self._for_autograd[0]

    def materialize(self) -> torch.Tensor:
        fresh_first = bool(self.sources) and isinstance(self.sources[0], PackedView)
        fn = self.fn_in_place if self.fn_in_place is not None and fresh_first else self.fn
        with torch.no_grad():
            return fn(*(unpack_saved(source) for source in self.sources)).reshape(-1)


@dataclass(frozen=True)
class PackedView:
    """What autograd holds instead of a saved tensor: its storage's stored form and its geometry in it.

    The form is a `BlockQuantized`, or anything with `bits` and `materialize()` (the storage's
    elements, flat, in a buffer of their own): a `DerivedStorage`, or an `OffloadedStorage` living off
    the device (lazyzero/activations/offload.py).
    """

    storage: object
    shape: torch.Size
    stride: tuple[int, ...]
    storage_offset: int

    def unpack(self, for_autograd: bool = False) -> torch.Tensor:
        """The tensor, in a buffer of its own; `for_autograd`: a recipe's buffer may be shared by
        every autograd node reading it (`DerivedStorage.materialize_for_autograd`)."""
        if isinstance(self.storage, BlockQuantized):
            flat = dequantize_blockwise(self.storage)
        elif for_autograd and isinstance(self.storage, DerivedStorage):
            flat = self.storage.materialize_for_autograd()
        else:
            flat = self.storage.materialize()
        return flat.as_strided(self.shape, self.stride, self.storage_offset)

    @classmethod
    def of(cls, storage, tensor: torch.Tensor) -> PackedView:
        return cls(storage, tensor.shape, tensor.stride(), tensor.storage_offset())


def storage_root(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor owning `tensor`'s storage (itself unless it is a view)."""
    return tensor if tensor._base is None else tensor._base


def _stored_bits(saved) -> int:
    if not isinstance(saved, PackedView):
        return KEEP_BITS
    return saved.storage.bits


def unpack_saved(saved) -> torch.Tensor:
    """The tensor behind what the pack hook returned (a PackedView, or the tensor itself); a PackedView
    gives a buffer of its own, which the caller may overwrite."""
    return saved.unpack() if isinstance(saved, PackedView) else saved


def unpack_for_autograd(saved) -> torch.Tensor:
    """`unpack_saved` as autograd's unpack hook: its nodes only read what they get, so the rebuilt
    storage of a recipe is shared between them."""
    return saved.unpack(for_autograd=True) if isinstance(saved, PackedView) else saved
