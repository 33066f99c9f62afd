"""Error feedback for int8 gradients: each rank's rounding error of one step, sent in the next.

A rank quantizes x = gradient + residual and keeps residual = x - dequantize(quantize(x))
(`quantized_reduce_scatter`). Round-to-nearest then has no lasting bias: a component too small
for its block's code step accumulates in the residual until it crosses the step and is sent.

The residual of exchange call k of a step is the residual of call k of the next step: DeepSpeed
fills its buckets in the same order every step (same model, same backward order), so call k
holds the same gradients each time. A call whose size changes (another bucketing) starts from
zero, with a warning, rather than adding one bucket's error to another's gradients.

Residuals are in the units of the gradients being reduced, which carry the loss scale under
fp16; when the scale changes, they are rescaled with it. After a skipped (overflowed) step they
are dropped: that step's gradients never reached the parameters, so neither may their error.

The residuals are per rank (each rank rounds its own gradients) and are saved in checkpoints
(`state_dict`, one file per rank; `LazyZeroEngine.save_checkpoint`).
"""

from __future__ import annotations

from typing import Callable

import torch
from deepspeed.utils import logger

STATE_FORMAT = 1


class ErrorFeedback:
    """The fp32 residuals of one rank's exchange calls, indexed by call within the step."""

    def __init__(self, loss_scale: Callable[[], float]):
        self._loss_scale = loss_scale
        self._residuals: list[torch.Tensor] = []
        self._residual_scale: float | None = None
        """The loss scale the residuals are expressed in (None before the first exchange)."""

    def residual(self, call: int, numel: int, device: torch.device) -> torch.Tensor:
        """The residual of exchange `call` (updated in place by the exchange)."""
        if call == 0:
            self._follow_loss_scale()
        if call > len(self._residuals):
            raise RuntimeError(f"exchange call {call} before call {len(self._residuals)} of this step")
        if call == len(self._residuals):
            self._residuals.append(torch.zeros(numel, dtype=torch.float32, device=device))
        residual = self._residuals[call]
        if residual.numel() != numel or residual.device != device:
            logger.warning(f"lazyzero error feedback: gradient exchange {call} now has {numel} elements, "
                           f"had {residual.numel()}; its residual restarts from zero")
            residual = self._residuals[call] = torch.zeros(numel, dtype=torch.float32, device=device)
        return residual

    def discard(self) -> None:
        """Zero every residual (after a skipped step)."""
        for residual in self._residuals:
            residual.zero_()

    def state_dict(self) -> dict:
        """CPU copies of the residuals and the loss scale they are in."""
        return {
            "format": STATE_FORMAT,
            "loss_scale": self._residual_scale,
            "residuals": [residual.detach().cpu().clone() for residual in self._residuals],
        }

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"error feedback state format {state.get('format')!r}; this lazyzero reads "
                             f"{STATE_FORMAT}")
        self._residuals = [residual.to(device=device, dtype=torch.float32) for residual in state["residuals"]]
        self._residual_scale = state["loss_scale"]

    def _follow_loss_scale(self) -> None:
        scale = float(self._loss_scale())
        if self._residual_scale is not None and scale != self._residual_scale:
            for residual in self._residuals:
                residual.mul_(scale / self._residual_scale)
        self._residual_scale = scale
