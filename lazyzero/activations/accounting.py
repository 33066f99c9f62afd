"""Bytes of saved activations per layer and per module kind, before and after packing (docs/activations.md),
and what the offload moved off the device (docs/plan.md).

The packer records each stored tensor once, where it is first saved: a tensor that several
operations save (the input of the q, k and v projections) is stored, and counted, once. Parameters
are not activations and are never counted. Offloaded bytes are the stored forms that left the device
(a part of `after`); backward's waits for offloaded tensors not yet back are the exposed transfer
time the planner predicts (lazyzero/activations/offload.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass


@dataclass
class SavedBytes:
    """Bytes autograd would hold unpacked (`before`), holds after packing (`after`), and of those
    the bytes moved off the device (`offloaded`)."""

    before: int = 0
    after: int = 0
    tensors: int = 0
    offloaded: int = 0

    def add(self, other: SavedBytes) -> None:
        self.before += other.before
        self.after += other.after
        self.tensors += other.tensors
        self.offloaded += other.offloaded

    @property
    def ratio(self) -> float:
        """after / before (1.0 when nothing was saved)."""
        return self.after / self.before if self.before else 1.0


class ActivationAccounting:
    """Running totals per (layer, kind); layer None is outside the decoder layers, kind None outside
    every managed module. The engine reads them after a step and calls `reset`."""

    def __init__(self) -> None:
        self._cells: dict[tuple[int | None, str | None], SavedBytes] = defaultdict(SavedBytes)
        # Unpacks that found their offloaded tensor not back yet, and the seconds they waited.
        self.offload_waits = 0
        self.offload_wait_s = 0.0

    def record(self, layer: int | None, kind: str | None, before: int, after: int, offloaded: int = 0) -> None:
        self._cells[(layer, kind)].add(SavedBytes(before, after, 1, offloaded))

    def record_wait(self, seconds: float) -> None:
        self.offload_waits += 1
        self.offload_wait_s += seconds

    def reset(self) -> None:
        self._cells.clear()
        self.offload_waits = 0
        self.offload_wait_s = 0.0

    def by_layer(self) -> dict[int | None, SavedBytes]:
        return self._group(lambda layer, kind: layer)

    def by_kind(self) -> dict[str | None, SavedBytes]:
        return self._group(lambda layer, kind: kind)

    def total(self) -> SavedBytes:
        return self._group(lambda layer, kind: None).get(None, SavedBytes())

    def _group(self, key) -> dict:
        groups: dict = defaultdict(SavedBytes)
        for (layer, kind), cell in self._cells.items():
            groups[key(layer, kind)].add(cell)
        return dict(groups)
