"""Cheap recomputation that lets quantized modules store fewer tensors (`recompute_elementwise`).

Packing alone stores every tensor autograd saves, each at 4 or 8 bits. Two kinds of module save
several tensors that are cheap elementwise functions of one another, so storing one and
recomputing the rest in backward costs a few elementwise passes and no matmul:

- **Norms** (RMSNorm, LayerNorm): HF's RMSNorm saves an fp32 copy of its input, 1/rms and the
  normalized input (6 bytes per element in a bf16 model). `recompute_from_input` makes the norm
  save only its input, packed at the norm's width, and rerun the norm in backward from it. Its
  output is a recipe over that input too, which a quantized consumer (the MLP's projections) uses
  instead of storing it again; a 16-bit consumer (attention) still keeps the exact output.
- **Gated MLPs** (Llama, Qwen2, Mistral: `down(act(gate(x)) * up(x))`): the activation output and
  the product are recipes over the stored gate and up outputs (`ActivationPacker.derive`), so the
  MLP stores x, gate(x) and up(x) instead of those plus act(gate) and the product.

Only modules whose width is below 16 bits are rewritten: a 16-bit module keeps its exact saved
tensors, and a recomputed layer (16 bits by the policy) is left to torch's checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


class _RecomputeFromInput(torch.autograd.Function):
    """y = run(x) saving only x; backward reruns `run` on the stored x and differentiates it."""

    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_output):
        (stored_x,) = ctx.saved_tensors
        wants_x, wants_params = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        # The rerun's own saved tensors stay local to this backward: never packed again.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            x = stored_x.detach().requires_grad_(wants_x)
            output = ctx.run(x)
        inputs = ([x] if wants_x else []) + [p for p, wanted in zip(ctx.params, wants_params) if wanted]
        grads = iter(torch.autograd.grad(output, inputs, grad_output, allow_unused=True) if inputs else ())
        grad_x = next(grads) if wants_x else None
        return (None, grad_x, *(next(grads) if wanted else None for wanted in wants_params))


def _keep(tensor):
    return tensor


def recompute_from_input(module: nn.Module, packer) -> None:
    """Make `module` (one tensor in, one out) save only its input and rerun itself in backward.

    The original bound `forward` is rerun, not `module(...)`: module hooks (ZeRO-3's gathers, the
    packer's scopes) run once, around the call; in backward ZeRO-3 has the parameters gathered for
    the module's backward already.
    """
    original = module.forward

    def forward(x):
        if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))):
            return original(x)
        output = _RecomputeFromInput.apply(original, x, *module.parameters())
        packer.derive(output, original, x)
        return output

    module.forward = forward


def is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, part) for part in GATED_MLP_PARTS)


def derive_gated_product(module: nn.Module, packer) -> None:
    """Run the gated MLP as `down(act(gate(x)) * up(x))` (the same operations in the same order as
    transformers' forward), telling `packer` that act(gate) and the product are recomputable."""

    def forward(x):
        gate = module.gate_proj(x)
        activated = module.act_fn(gate)
        packer.derive(activated, module.act_fn, gate)
        up = module.up_proj(x)
        product = activated * up
        packer.derive(product, torch.mul, activated, up)
        return module.down_proj(product)

    module.forward = forward


def restore_forward(module: nn.Module) -> None:
    """Undo a rewrite above (the class's forward applies again)."""
    module.__dict__.pop("forward", None)
