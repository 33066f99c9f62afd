"""`GradientExchange`: the int8 gradient collectives of one engine, with per-step bookkeeping (docs/gradients.md).

The ZeRO hooks (`grad_exchange_hooks.py`) call `reduce_scatter` or `all_reduce` for every gradient
bucket instead of DeepSpeed's full-precision collective, then `finish_step` once per optimizer step.
This object keeps what must persist across those calls:

* the scratch buffers of the collectives (`ExchangeBuffers`), reused bucket after bucket;
* the stochastic-rounding seed of each call, from the user's seed, the engine's step and the
  call's index within the step, so every bucket of every step rounds with fresh noise that a
  resumed run reproduces exactly (all ranks issue the same calls in the same order);
* a device-side overflow marker: a NaN or Inf in any reduced output makes it Inf without a host
  sync; `finish_step` turns it into one decision shared by every rank (`any_nonfinite`,
  docs/reliability.md row 9). One agreement per step instead of one per bucket: the decision is only
  needed at the step, and each agreement is a blocking collective;
* bytes sent and seconds spent, reported as the metrics of the last finished step;
* with error feedback, one fp32 residual per exchange call of a step (`ErrorFeedback`), carried to
  the same call of the next step and saved in checkpoints.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from lazyzero.gradients import (
    ChunkLayout,
    ExchangeBuffers,
    NodeGroups,
    any_nonfinite,
    group_ranks,
    quantized_all_reduce,
    quantized_reduce_scatter,
    two_hop_reduce_scatter,
)
from lazyzero.gradients.config import GradientsConfig
from lazyzero.gradients.error_feedback import ErrorFeedback

# Strides of the (seed, step, call) triple in a call's seed: distinct triples get distinct seeds
# for up to 2**20 bucket exchanges per step and 2**40 steps.
_CALLS_PER_STEP = 2**20
_STEPS_PER_SEED = 2**40


class GradientExchange:
    """Int8 reduce-scatter and all-reduce of gradient buckets, with overflow and traffic accounting."""

    def __init__(
        self,
        config: GradientsConfig,
        device: torch.device,
        current_step: Callable[[], int],
        loss_scale: Callable[[], float] = lambda: 1.0,
        nodes: NodeGroups | None = None,
    ):
        """`current_step` returns the optimizer steps taken so far (restored on resume);
        `loss_scale` the factor the gradients being reduced carry (the residuals are rescaled
        when it changes); `nodes`, when set, makes exchanges over its group take two hops."""
        self.config = config
        self.nodes = nodes
        self._groups_checked: set[int] = set()
        """ids of the groups already found to be the two-hop layout's."""
        self.device = device
        self._current_step = current_step
        self._buffers = ExchangeBuffers()
        self.error_feedback = ErrorFeedback(loss_scale) if config.error_feedback else None
        self._reset_step()
        self.last_step_metrics: dict = {}
        """Metrics of the last finished optimizer step (empty before the first)."""

    def reduce_scatter(
        self, flat: torch.Tensor, group: dist.ProcessGroup | None, layout: ChunkLayout, scale: float
    ) -> torch.Tensor:
        """fp32: this rank's pieces of `layout`, summed over `group` and multiplied by `scale`."""
        started = time.perf_counter()
        call = self._next_call()
        options = dict(block_size=self.config.block_size, stochastic=self.config.stochastic_rounding,
                       seed=self._seed(call), scale=scale, residual=self._residual(call, flat), layout=layout,
                       buffers=self._buffers)
        if self._two_hop(group):
            result = two_hop_reduce_scatter(flat, self.nodes, **options)
            rank = result.rank
        else:
            result = quantized_reduce_scatter(flat, group, **options)
            rank = result.plan.rank
        self._record(result.output, result.wire_bytes, layout.fp32_bytes_sent(rank), started)
        return result.output

    def all_reduce(self, flat: torch.Tensor, group: dist.ProcessGroup | None, scale: float) -> torch.Tensor:
        """fp32 of `flat`'s shape: the sum over `group` times `scale`, identical on every rank."""
        started = time.perf_counter()
        call = self._next_call()
        result = quantized_all_reduce(
            flat, group, block_size=self.config.block_size, stochastic=self.config.stochastic_rounding,
            seed=self._seed(call), scale=scale, residual=self._residual(call, flat), buffers=self._buffers,
            nodes=self.nodes if self._two_hop(group) else None)
        plan = result.plan
        # A ring all-reduce is a reduce-scatter followed by an all-gather of the same chunks.
        self._record(result.output, result.wire_bytes, 2 * plan.layout.fp32_bytes_sent(plan.rank), started)
        return result.output

    def finish_step(self) -> bool:
        """Close the optimizer step: True on every rank when any rank reduced a NaN or Inf.

        A collective over all ranks; called exactly once per optimizer step, on every rank.
        """
        overflow = any_nonfinite(self._overflow_marker)
        if overflow and self.error_feedback is not None:
            self.error_feedback.discard()
        self.last_step_metrics = {
            "grad_wire_bytes": self._wire_bytes,
            "grad_fp32_wire_bytes": self._fp32_wire_bytes,
            "grad_exchange_s": self._seconds,
            "grad_overflow": overflow,
        }
        self._reset_step()
        return overflow

    def state_dict(self) -> dict | None:
        """What a resumed run needs to round as this one would: the error-feedback residuals
        (None without error feedback; seeds derive from the step, which DeepSpeed restores)."""
        return None if self.error_feedback is None else self.error_feedback.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.error_feedback is not None and state is not None:
            self.error_feedback.load_state_dict(state, self.device)

    def _two_hop(self, group: dist.ProcessGroup | None) -> bool:
        """True when `group` is the one the node groups were built for (same ranks)."""
        if self.nodes is None:
            return False
        if id(group) not in self._groups_checked:
            ranks = group_ranks(group)
            if ranks != group_ranks(self.nodes.group):
                raise NotImplementedError(
                    f"lazyzero.gradients: a gradient exchange over ranks {ranks}, not the data-parallel group the "
                    "two-hop layout was built for; set lazyzero.gradients.ranks_per_node to 1 for one hop")
            self._groups_checked.add(id(group))
        return True

    def _next_call(self) -> int:
        """Index of this exchange within the optimizer step, from 0."""
        self._calls += 1
        return self._calls - 1

    def _seed(self, call: int) -> int:
        step = self._current_step() % _STEPS_PER_SEED
        return (self.config.seed * _STEPS_PER_SEED + step) * _CALLS_PER_STEP + (call + 1) % _CALLS_PER_STEP

    def _residual(self, call: int, flat: torch.Tensor) -> torch.Tensor | None:
        if self.error_feedback is None:
            return None
        return self.error_feedback.residual(call, flat.numel(), flat.device)

    def _record(self, output: torch.Tensor, wire_bytes: int, fp32_wire_bytes: int, started: float) -> None:
        # Stays on the device: Inf added when this output holds a NaN or Inf, 0 otherwise.
        self._overflow_marker.add_(torch.where(torch.isfinite(output).all(), 0.0, float("inf")))
        self._wire_bytes += wire_bytes
        self._fp32_wire_bytes += fp32_wire_bytes
        self._seconds += time.perf_counter() - started

    def _reset_step(self) -> None:
        self._calls = 0
        self._overflow_marker = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._wire_bytes = 0
        self._fp32_wire_bytes = 0
        self._seconds = 0.0
