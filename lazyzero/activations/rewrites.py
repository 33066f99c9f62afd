"""Cheap recomputation that lets quantized modules store fewer tensors (`recompute_elementwise`).

Packing alone stores every tensor autograd saves, each at 4 or 8 bits. Two kinds of module save
several tensors that are cheap elementwise functions of one another, so storing one and
recomputing the rest in backward costs a few elementwise passes and no matmul:

- **Norms** (RMSNorm, LayerNorm): HF's RMSNorm saves an fp32 copy of its input, 1/rms and the
  normalized input (6 bytes per element in a bf16 model). `recompute_from_input` makes the norm
  save only its input, packed at the norm's width, and rerun the norm in backward from it (for
  transformers' RMSNorms, its gradients in closed form from that input instead, one native call:
  lazyzero/ops/norms.py). Its
  output is a recipe over that input too, which a consumer storing it no wider than the norm (the
  MLP's projections, the attention's: see policy.py) uses instead of storing it again; a 16-bit
  consumer keeps the exact output. (Not
  where ZeRO-3 partitions the norm's weight, gathered only for the norm's own passes.)
- **Gated MLPs** (Llama, Qwen2, Mistral: `down(act(gate(x)) * up(x))`): the product is a recipe
  over the stored gate and up outputs (`ActivationPacker.derive`) and act(gate) is not kept, so the
  MLP stores x, gate(x) and up(x) instead of those plus act(gate) and the product.

Only modules whose width is below 16 bits are rewritten: a 16-bit module keeps its exact saved
tensors, and a recomputed layer (16 bits by the policy) is left to torch's checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from lazyzero.activations.stored import PackedView, unpack_saved
from lazyzero.ops import norms, norms_reference
from lazyzero.patch_point import clear_state, set_state

_OWNER = "lazyzero.activations (saved-activation rewrites)"
# A forward set on the instance: nn.Module.__call__ runs `self.forward` (patch_point.py, SET).
_MODULE = "torch.nn.modules.module:Module"

GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


# Elements per piece of rows in a norm's backward and rebuilt output. HF's RMSNorm differentiated
# by autograd holds several fp32 copies of its input at once, which at long sequences set the
# step's peak memory. On the CPU a piece is sized so that its fp32 copies fit in L2, which also keeps
# the chain of elementwise passes in cache. On a GPU each piece costs a dozen kernel launches whatever
# its size, so a piece is sized for each fp32 pass to take longer than launching it
# (docs/activations.md, "On a GPU"; measurements: benchmarks/results/records/2026-12-02-activations-runs.md).
# transformers' RMSNorms skip the pieces where the native kernels run (lazyzero/ops/norms.py).
DEVICE_PIECE_ELEMENTS = 1 << 22
CPU_PIECE_ELEMENTS = 1 << 17


def row_pieces(rows: torch.Tensor) -> list[slice]:
    """Slices of `rows` (a 2-D tensor, one position per row) piece by piece, for its device."""
    elements = CPU_PIECE_ELEMENTS if rows.device.type == "cpu" else DEVICE_PIECE_ELEMENTS
    step = max(1, elements // max(1, rows.shape[-1]))
    return [slice(start, start + step) for start in range(0, rows.shape[0], step)]


def by_row_pieces(run):
    """`run` (an operation on each row of its input's last dimension alone, as norms are) applied a
    piece of rows at a time into one output: the same values, with temporaries of a piece's size."""

    def run_in_pieces(x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        pieces = row_pieces(rows)
        if len(pieces) <= 1:  # also no rows at all
            return run(x)
        first, *rest = pieces
        first_output = run(rows[first])  # gives the output's dtype and width
        output = first_output.new_empty((rows.shape[0], first_output.shape[-1]))
        output[first] = first_output
        for piece in rest:
            output[piece] = run(rows[piece])
        return output.reshape(*x.shape[:-1], first_output.shape[-1])

    return run_in_pieces


class _RecomputeFromInput(torch.autograd.Function):
    """y = run(x) saving only x; backward reruns `run` on the stored x and differentiates it.

    `run` must treat each position (each row of x's last dimension) on its own, as norms do: backward
    reruns and differentiates it a piece of rows at a time (`row_pieces`), which bounds
    its temporaries; parameter gradients are summed over the pieces in fp32.
    """

    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.params = run, params
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_output):
        (stored_x,) = ctx.saved_tensors
        wants_x, wants_params = ctx.needs_input_grad[1], ctx.needs_input_grad[2:]
        params = [p for p, wanted in zip(ctx.params, wants_params) if wanted]
        rows_x = stored_x.reshape(-1, stored_x.shape[-1]) if stored_x.dim() > 1 else stored_x.reshape(1, -1)
        rows_grad = grad_output.reshape(rows_x.shape[0], -1)
        grad_x = torch.empty_like(rows_x) if wants_x else None
        param_sums = [None] * len(params)
        for piece in row_pieces(rows_x):
            grads = _rerun_and_differentiate(ctx.run, rows_x[piece], rows_grad[piece], wants_x, params)
            if wants_x:
                grad_x[piece] = grads.pop(0)
            for index, grad in enumerate(grads):
                if grad is not None:
                    total = param_sums[index]
                    param_sums[index] = grad.float() if total is None else total + grad.float()
        param_grads = iter(None if total is None else total.to(p.dtype) for total, p in zip(param_sums, params))
        grad_x = grad_x.reshape(stored_x.shape) if wants_x else None
        return (None, grad_x, *(next(param_grads) if wanted else None for wanted in wants_params))


def _rerun_and_differentiate(run, x_rows, grad_rows, wants_x: bool, params: list) -> list:
    """Gradients of `run` on some rows of its input: [grad x (if wanted), grad of each of `params`]."""
    # The rerun's own saved tensors stay local to this backward: never packed again.
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
        x = x_rows.detach().requires_grad_(wants_x)
        output = run(x)
    inputs = ([x] if wants_x else []) + params
    if not inputs:
        return []
    return list(torch.autograd.grad(output, inputs, grad_rows.reshape(output.shape), allow_unused=True))


def _keep(tensor):
    return tensor


# transformers' RMSNorm of these families: w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in fp32.
HF_RMS_NORMS = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})


class _RMSNormFromInput(torch.autograd.Function):
    """An RMSNorm of `HF_RMS_NORMS` saving only its input x; backward is the closed form, in half the
    time of rerunning the norm's ops and differentiating them: one native call (`lazyzero.ops.norms`),
    or `rms_norm_backward` where the native CPU kernels cannot be built."""

    @staticmethod
    def forward(ctx, run, x, weight, eps):
        ctx.weight, ctx.eps = weight, eps  # weight read in backward, where ZeRO-3 has it gathered
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_output):
        (stored_x,) = ctx.saved_tensors
        wants = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        backward = norms.rms_norm_rows_backward if norms.native_available(stored_x.device) else rms_norm_backward
        grad_x, grad_weight = backward(stored_x, grad_output, ctx.weight.detach(), ctx.eps, *wants)
        return None, grad_x, grad_weight, None


def rms_norm_backward(x: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor, eps: float,
                      wants_x: bool = True, wants_weight: bool = True):
    """Gradients (of x, of weight; None where not wanted) of y = w * bf16(x̂), x̂ = x * r,
    r = rsqrt(mean(x^2) + eps), from x alone: with g = w * dy, dx = r * (g - x̂ * mean(g * x̂)) and
    dw = sum over rows of dy * x̂. The reference's maths (`norms_reference.rms_norm_rows_gradients`)
    a piece of rows at a time (`row_pieces`), the weight's sums kept in fp32 across pieces."""
    width = x.shape[-1]
    rows_x = x.reshape(-1, width)
    rows_grad = grad_output.reshape(rows_x.shape)
    grad_x = torch.empty_like(rows_x) if wants_x else None
    weight_sum = torch.zeros(width, dtype=torch.float32, device=x.device) if wants_weight else None
    for piece in row_pieces(rows_x):
        piece_x, piece_sum = norms_reference.rms_norm_rows_gradients(rows_x[piece], rows_grad[piece], weight, eps,
                                                                     wants_x, wants_weight)
        if wants_weight:
            weight_sum += piece_sum
        if wants_x:
            grad_x[piece] = piece_x
    return (grad_x.reshape(x.shape) if wants_x else None,
            weight_sum.to(weight.dtype) if wants_weight else None)


def rebuild_output(module: nn.Module, original):
    """The module's output from its input, for its consumers' backward: for an HF RMSNorm one native
    call (`norms.rms_norm_rows`) where the native kernels run, else `original` by pieces of rows."""
    in_pieces = by_row_pieces(original)
    if not _is_hf_rms_norm(module):
        return in_pieces

    def rebuild(x: torch.Tensor) -> torch.Tensor:
        if norms.native_available(x.device):
            return norms.rms_norm_rows(x, module.weight.detach(), module.variance_epsilon)
        return in_pieces(x)

    return rebuild


def _is_hf_rms_norm(module: nn.Module) -> bool:
    return (type(module).__name__ in HF_RMS_NORMS and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float))


def recompute_from_input(module: nn.Module, packer) -> None:
    """Make `module` (one tensor in, one out) save only its input and rerun itself in backward.

    The original bound `forward` is rerun, not `module(...)`: module hooks (ZeRO-3's gathers, the
    packer's scopes) run once, around the call; in backward ZeRO-3 has the parameters gathered for
    the module's backward already.
    """
    original = module.forward
    rebuild = rebuild_output(module, original)
    hf_rms_norm = _is_hf_rms_norm(module)

    def forward(x):
        if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))):
            return original(x)
        if hf_rms_norm:
            output = _RMSNormFromInput.apply(original, x, module.weight, module.variance_epsilon)
        else:
            output = _RecomputeFromInput.apply(original, x, *module.parameters())
        if not _zero3_partitioned(module):
            packer.derive(output, rebuild, x)
        return output

    set_state(module, "forward", forward, owner=_OWNER, holder=_MODULE)


def _zero3_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 partitions the module's parameters (below `stage3_param_persistence_threshold`
    it keeps them whole: `ds_persist`). Partitioned ones are gathered only around the module's own
    forward and backward, and a recipe replayed in a consumer's backward (the MLP's, which runs
    before the norm's) could find them released: the output is stored instead."""
    return any(hasattr(param, "ds_id") and not getattr(param, "ds_persist", False) for param in module.parameters())


def is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, part) for part in GATED_MLP_PARTS)


class _SiluProduct(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up (autograd would also keep silu(gate)); backward
    computes both gradients with two buffers fewer than autograd's mul and silu backward.

    gate and up come stored by `packer.store` (called by the caller: inside `forward` autograd is
    off) and stay on the ctx rather than in `save_for_backward`, so that backward knows which of
    them it rebuilds into a buffer of its own and may overwrite.
    """

    @staticmethod
    def forward(ctx, gate, up, stored):
        ctx.stored = stored
        return silu_product(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate_form, up_form = ctx.stored
        ctx.stored = None
        gate, up = unpack_saved(gate_form), unpack_saved(up_form)
        grad_up = nn.functional.silu(gate).mul_(grad)
        grad_gate = up.mul_(grad) if isinstance(up_form, PackedView) else up * grad
        del up
        # silu's derivative written over its input gradient (elementwise, so aliasing is exact).
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        return grad_gate, grad_up, None


def silu_product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up into one new buffer (the same values as transformers' `act_fn(gate) * up`)."""
    return nn.functional.silu(gate).mul_(up)


def is_silu(module: nn.Module) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def derive_gated_product(module: nn.Module, packer) -> None:
    """Run the gated MLP `down(act(gate(x)) * up(x))` so that it stores only x, gate(x) and up(x):
    the product is a recipe over gate and up (`packer.derive`). With SiLU (Llama, Qwen2, Mistral)
    the product is one autograd node (`_SiluProduct`) that does not keep silu(gate) either; other
    activations keep autograd's nodes, their output a recipe too. Each intermediate is dropped as
    soon as it is used: autograd holds only the stored forms."""
    silu = is_silu(module.act_fn)

    def forward(x):
        gate = module.gate_proj(x)
        up = module.up_proj(x)
        if silu:
            product = _SiluProduct.apply(gate, up, (packer.store(gate), packer.store(up)))
            packer.derive(product, silu_product, gate, up)
        else:
            activated = module.act_fn(gate)
            packer.derive(activated, module.act_fn, gate)
            product = activated * up
            packer.derive(product, torch.mul, activated, up, fn_in_place=torch.Tensor.mul_)
            del activated
        del gate, up
        return module.down_proj(product)

    set_state(module, "forward", forward, owner=_OWNER, holder=_MODULE)


def restore_forward(module: nn.Module) -> None:
    """Undo a rewrite above (the class's forward applies again)."""
    clear_state(module, "forward", owner=_OWNER, holder=_MODULE)
