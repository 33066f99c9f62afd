"""The loss head of a causal LM without saved logits: cross-entropy and its gradients in one pass.

A causal LM's loss keeps its logits for backward, in fp32 (transformers upcasts them before the
cross-entropy): 4 x vocabulary bytes per token. With SmolLM2's 49152-token vocabulary that is 196 KB
per token, more than all 30 decoder layers store under the default policy. The gradient of the
cross-entropy with respect to the logits is known in forward (softmax minus the one-hot label, over
the number of predicted tokens), so the head's two gradient matmuls can run right there, a chunk of
tokens at a time, and backward only scales what they produced by the incoming gradient: the same
three matmuls as before, no recomputation, and no logits kept (docs/activations.md, "The loss head").

What backward then holds is the gradient of the hidden states (one hidden vector per token) and the
head's weight gradient (one weight-sized tensor, whatever the batch): less than the logits from a few
hundred tokens on.

`install_fused_loss(model)` rewrites a transformers causal LM so that a call with `labels` while
autograd records takes this path; the output then carries the loss and no logits. Any other call
(evaluation and generation under no_grad, calls without labels) runs the model's own forward.
"""

from __future__ import annotations

import torch
from torch import nn

from lazyzero.patch_point import clear_state, set_state

_OWNER = "lazyzero.activations (fused loss head)"
# A forward set on the instance: nn.Module.__call__ runs `self.forward` (patch_point.py, SET).
_MODULE = "torch.nn.modules.module:Module"

IGNORE_INDEX = -100  # transformers' label for positions that are not predicted
CHUNK_ELEMENTS = 1 << 23  # fp32 logits per softmax chunk: 32 MB, whatever the vocabulary
GRAD_CHUNK_ELEMENTS = 1 << 26  # logits' gradients (model dtype) per matmul: 128 MB in bf16


class _FusedCrossEntropy(torch.autograd.Function):
    """loss = sum over predicted tokens of (logsumexp(logits) - logit[label]) / denominator, with
    logits = hidden @ weight.T computed chunk by chunk and never kept.

    The logits' gradients of up to GRAD_CHUNK_ELEMENTS go to one buffer in the model's dtype (what the
    logits' own dtype would carry back), filled a softmax chunk at a time; the two gradient matmuls then
    run once over the whole buffer. Small matmuls per softmax chunk, each adding a weight-sized product
    into an fp32 sum, took several times as long as one large one."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, denominator: float):
        grad_hidden = torch.empty_like(hidden)
        grad_weight = None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = max(1, GRAD_CHUNK_ELEMENTS // weight.shape[0])
        for start in range(0, hidden.shape[0], rows):
            chunk = hidden[start:start + rows]
            grad_logits = torch.empty((chunk.shape[0], weight.shape[0]), dtype=hidden.dtype, device=hidden.device)
            total += _fill_logit_gradients(grad_logits, chunk, weight, labels[start:start + rows], denominator)
            torch.matmul(grad_logits, weight, out=grad_hidden[start:start + rows])
            product = grad_logits.T @ chunk
            del grad_logits
            grad_weight = product if grad_weight is None else grad_weight.float().add_(product)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / denominator

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * grad_loss.to(grad_weight.dtype), None, None


def _fill_logit_gradients(out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          denominator: float) -> torch.Tensor:
    """Write d loss / d logits of `hidden`'s tokens into `out` (in its dtype), CHUNK_ELEMENTS fp32 logits at
    a time; returns their summed loss."""
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    rows = max(1, CHUNK_ELEMENTS // weight.shape[0])
    for start in range(0, hidden.shape[0], rows):
        loss_sum, grad_logits = _chunk_loss_and_grad(hidden[start:start + rows] @ weight.T,
                                                     labels[start:start + rows], denominator)
        total += loss_sum
        out[start:start + rows].copy_(grad_logits)
    return total


def _chunk_loss_and_grad(logits: torch.Tensor, labels: torch.Tensor, denominator: float):
    """(summed loss of the chunk's predicted tokens, d loss / d logits in fp32), working in place on
    the fp32 logits so that the chunk holds one logits-sized buffer."""
    logits = logits.float()
    predicted = labels != IGNORE_INDEX
    targets = labels.clamp(min=0)[:, None]
    log_normalizer = torch.logsumexp(logits, dim=-1)
    target_logits = logits.gather(1, targets).squeeze(1)
    loss_sum = ((log_normalizer - target_logits) * predicted).sum()
    probabilities = logits.sub_(log_normalizer[:, None]).exp_()
    probabilities.scatter_add_(1, targets, -predicted.to(probabilities.dtype)[:, None])
    probabilities.mul_((predicted.to(probabilities.dtype) / denominator)[:, None])
    return loss_sum, probabilities


def fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                        num_items_in_batch=None) -> torch.Tensor:
    """transformers' causal-LM loss (labels shifted by one, IGNORE_INDEX skipped, mean over predicted
    tokens or sum over `num_items_in_batch`) of `hidden` [.., seq, H] through a bias-free head `weight`
    [V, H], without keeping logits. `labels` [.., seq] are the unshifted labels."""
    shifted = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), shifted.reshape(-1).to(hidden.device)
    if num_items_in_batch is not None:
        denominator = float(num_items_in_batch)
    else:
        denominator = float(max(int((flat_labels != IGNORE_INDEX).sum()), 1))
    return _FusedCrossEntropy.apply(flat_hidden, weight, flat_labels, denominator)


def supports_fused_loss(model: nn.Module) -> bool:
    """A transformers causal LM whose loss is the plain cross-entropy of a bias-free linear head over
    its base model's last hidden state (no logit soft-capping, no scaling of the logits)."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    base = getattr(model, "base_model", None)
    return (
        config is not None and isinstance(head, nn.Linear) and head.bias is None
        and base is not None and base is not model
        and getattr(config, "final_logit_softcapping", None) is None
        and getattr(config, "logit_scale", None) is None
        and type(model).__name__.endswith("ForCausalLM")
    )  # fmt: skip


def install_fused_loss(model: nn.Module) -> bool:
    """Route `model`'s training calls with labels through `fused_cross_entropy` (see the module
    docstring); returns whether it did (models `supports_fused_loss` refuses keep their forward).

    The head's matmuls run inside a call of the head module itself, so that ZeRO-3 gathers its weight
    around them as it would for the plain head; `remove_fused_loss` undoes both rewrites.
    """
    if not supports_fused_loss(model):
        return False
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward
    head = model.get_output_embeddings()

    def head_forward(hidden, labels=None, num_items_in_batch=None):
        if labels is None:
            return nn.functional.linear(hidden, head.weight)
        return fused_cross_entropy(hidden, head.weight, labels, num_items_in_batch)

    def forward(*args, labels=None, **kwargs):
        fused = (labels is not None and torch.is_grad_enabled()
                 and kwargs.get("shift_labels") is None and kwargs.get("return_dict", True) is not False)
        if not fused:
            return original(*args, labels=labels, **kwargs)
        num_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        outputs = model.base_model(*args, **kwargs)
        loss = head(outputs[0], labels=labels, num_items_in_batch=num_items)
        rest = {key: value for key, value in outputs.items() if key != "last_hidden_state"}  # cache, hidden states...
        return CausalLMOutputWithPast(loss=loss, logits=None, **rest)

    set_state(head, "forward", head_forward, owner=_OWNER, holder=_MODULE)
    set_state(model, "forward", forward, owner=_OWNER, holder=_MODULE)
    return True


def remove_fused_loss(model: nn.Module) -> None:
    """Undo `install_fused_loss` (the classes' forwards apply again)."""
    clear_state(model, "forward", owner=_OWNER, holder=_MODULE)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        clear_state(head, "forward", owner=_OWNER, holder=_MODULE)
