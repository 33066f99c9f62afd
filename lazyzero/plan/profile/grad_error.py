"""How much each decoder layer's gradients suffer when its saved activations are stored at 8 or 4
bits, measured on the run's own model and profiling batch (docs/plan.md, "Quality").

The same width costs very different errors on different weights: storing the MLPs' activations at 4
bits gives SmolLM2-135M ten times the gradient error it gives the randomly initialized demo preset
(docs/activations.md), and within one model a layer whose residual stream carries a massive channel
suffers more than its neighbours. So every layer is measured, not one per shape.

For each layer: its exact input and the exact gradient arriving at its output, from the model's own
forward and backward; then the layer alone, once without packing and once per width under the
activation packer with the run's width rules (`profiling_config`), each backward fed that gradient.
The error of a width is the larger of two relative L2 errors: of the layer's parameter gradients
(all of them as one vector) and of its input gradient (which carries the error on to every earlier
layer).

The model's backward is taken layer by layer rather than in one pass over the whole model: a forward
without autograd keeps each layer's arguments, the head's backward gives the gradient at the last
layer's output, and each layer's exact backward, which the comparison needs anyway, gives the
gradient at the previous layer's output. The gradients are the same as one whole backward's (each
layer is fed exactly the previous layer's output, `ModelCalls.chained`), but no more than one layer's
activations are alive at a time, on the profiling device like the other layer measurements: the
profiler runs before any plan, within the budget the plan is for.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lazyzero.activations import ActivationPolicy
from lazyzero.activations.config import ActivationsConfig
from lazyzero.plan.profile.layers import (
    ModelCalls,
    PassThrough,
    decoder_bench,
    decoder_layers,
    head_shell,
    layers_replaced,
    profiling_config,
)
from lazyzero.plan.solver.problem import REDUCED_WIDTHS


def grad_errors(model: nn.Module, calls: ModelCalls, batch: dict, config: ActivationsConfig, device: torch.device,
                seed: int, on_layer: Callable[[int], None] = lambda done: None) -> dict[str, dict[int, float]]:
    """Per decoder layer (by name, in order), width -> gradient error (16 -> 0.0), see the module
    docstring. `calls`: the model's decoder layers on `batch`; `on_layer(n)` after n layers."""
    if not calls.chained:
        raise ValueError(f"{type(model).__name__}: a decoder layer is not fed the previous layer's output, so the "
                         "gradient at its input is not the one at that output (gradient errors need a chain of layers)")
    policies = {bits: ActivationPolicy(profiling_config(config, bits)) for bits in REDUCED_WIDTHS}
    grad_out = loss_gradient_at_last_layer(model, calls, batch, device)
    errors = {}
    for done, name in enumerate(reversed(calls.calls), start=1):
        bench = decoder_bench(model, name, calls.calls[name], device, seed, grad_out=grad_out)
        exact = bench.gradients(None)
        errors[name] = {16: 0.0, **{bits: gradient_error(bench.gradients(policy), exact)
                                    for bits, policy in policies.items()}}
        grad_out = exact[0]
        on_layer(done)
    return {name: errors[name] for name in calls.calls}


def loss_gradient_at_last_layer(model: nn.Module, calls: ModelCalls, batch: dict,
                                device: torch.device | None = None) -> torch.Tensor:
    """The loss's gradient at the last decoder layer's output: a copy of the model with its decoder
    layers standing aside and the last one returning its recorded output (final norm, head and loss
    run as in training), on `device` (default: the batch's). The model itself is left untouched."""
    device = device or next(iter(batch.values())).device
    names = list(calls.calls)
    returns_tuple = calls.calls[names[-1]].returns_tuple
    last = calls.last_output.detach().to(device).requires_grad_(True)
    shell = head_shell(model, list(decoder_layers(model)), returns_tuple, device)
    with layers_replaced(shell, {names[-1]: PassThrough(returns_tuple, output=last)}):
        loss = shell(**{key: value.to(device) for key, value in batch.items()}).loss
    return torch.autograd.grad(loss, last)[0]


def gradient_error(found: list[torch.Tensor | None], exact: list[torch.Tensor | None]) -> float:
    """max(relative L2 error of the parameters' gradients together, that of the input's gradient);
    the lists hold the input's gradient first (`LayerBench.gradients`)."""
    return max(relative_l2(found[1:], exact[1:]), relative_l2(found[:1], exact[:1]))


def relative_l2(found: list[torch.Tensor | None], exact: list[torch.Tensor | None]) -> float:
    """||found - exact|| / ||exact|| over all the tensors as one vector, in fp64 (None: no gradient,
    the same in both). An all-zero exact gradient (nothing reaches it) has nothing to lose: 0."""
    # One tensor at a time in fp64: a whole layer's gradients at once would hold 4 times its
    # parameters' bytes again (the profile runs inside the budget being planned for).
    sums = [_squares(f, e) for f, e in zip(found, exact) if e is not None]
    norm = sum(exact_sum for _, exact_sum in sums)
    if norm == 0:
        return 0.0
    return math.sqrt(sum(error_sum for error_sum, _ in sums) / norm)


def _squares(found: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(sum of (found - exact)^2, sum of exact^2), in fp64."""
    exact = exact.double()
    return float((found.double() - exact).pow(2).sum()), float(exact.pow(2).sum())
