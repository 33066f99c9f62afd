"""Cheap recomputation in quantized modules (lazyzero/activations/rewrites.py) and non-finite saves."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from lazyzero.activations import ActivationPacker, ActivationPolicy, rewrites
from lazyzero.activations.config import ActivationsConfig
from lazyzero.activations.rewrites import rms_norm_backward
from lazyzero.models.build import build_model
from lazyzero.models.config import FAMILIES
from lazyzero.testing import TOLERANCES, cosines_by_name


class Holder(torch.nn.Module):
    """`module` under a name the policy classifies ("mlp", "norm") and quantizes."""

    def __init__(self, name: str, module: torch.nn.Module):
        super().__init__()
        self.add_module(name, module)
        self.name = name

    def forward(self, x):
        return getattr(self, self.name)(x)


def llama_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=172, num_attention_heads=4, vocab_size=32)


def outputs_and_grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad()
    leaf = x.clone().requires_grad_(True)
    out = module(leaf)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return [out.detach(), leaf.grad] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("make", [lambda: LlamaRMSNorm(64), lambda: torch.nn.LayerNorm(64),
                                  lambda: LlamaMLP(llama_config())], ids=["rmsnorm", "layernorm", "gated_mlp"])
def test_rewritten_modules_compute_exactly_what_the_originals_do(make):
    """Outside `with packer:` nothing is packed, so a rewrite must be exact: same values, same grads;
    the RMSNorm's closed-form gradients differ from autograd's order of operations by fp32 rounding."""
    torch.manual_seed(0)
    module = make()
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    x = torch.randn(2, 8, 64)
    expected = outputs_and_grads(module, x)
    packer = ActivationPacker(Holder("mlp" if isinstance(module, LlamaMLP) else "norm", module),
                              ActivationPolicy(ActivationsConfig()))
    assert "forward" in vars(module)  # rewritten
    found = outputs_and_grads(module, x)
    torch.testing.assert_close(found[0], expected[0], rtol=0, atol=0)
    exact = not isinstance(module, LlamaRMSNorm)
    for a, b in zip(found[1:], expected[1:]):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-6)
    packer.remove()
    assert "forward" not in vars(module)


def test_closed_form_rms_norm_gradients_in_bf16_are_as_close_to_fp64_as_autograds():
    """bf16 input and gradient: both the closed form (fp32 inside) and autograd through HF's norm
    (which rounds w * dy and dy * x̂ to bf16) carry bf16 rounding; against fp64 the closed form is
    no worse (a bound of 1.5x autograd's own error, and bf16's 2^-8 relative, on each gradient)."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.add_(torch.randn(64).to(torch.bfloat16) * 0.1)
    x = torch.randn(4, 300, 64).to(torch.bfloat16)  # 1200 rows: pieces of 500 leave a short last one
    dy = torch.randn(x.shape).to(torch.bfloat16)

    def autograd_grads(dtype):
        module = LlamaRMSNorm(64).to(dtype)
        with torch.no_grad():
            module.weight.copy_(norm.weight)
        leaf = x.to(dtype).requires_grad_(True)
        module(leaf).backward(dy.to(dtype))
        return leaf.grad.double(), module.weight.grad.double()

    reference, bf16_autograd = autograd_grads(torch.float64), autograd_grads(torch.bfloat16)
    closed_form = rms_norm_backward(x, dy, norm.weight.detach(), norm.variance_epsilon)
    pieces = rewrites.CPU_PIECE_ELEMENTS
    try:
        rewrites.CPU_PIECE_ELEMENTS = 500 * 64
        assert torch.equal(rms_norm_backward(x, dy, norm.weight.detach(), norm.variance_epsilon)[0], closed_form[0])
        assert torch.equal(rewrites.by_row_pieces(norm)(x), norm(x))  # the rebuilt output, in 3 pieces
    finally:
        rewrites.CPU_PIECE_ELEMENTS = pieces
    for found, theirs, exact in zip(closed_form, bf16_autograd, reference):
        error = (found.double() - exact).norm() / exact.norm()
        assert error <= max(1.5 * (theirs - exact).norm() / exact.norm(), 2**-8), error


def test_sixteen_bit_modules_and_the_switch_leave_modules_as_they_are():
    norm = LlamaRMSNorm(64)
    ActivationPacker(Holder("norm", norm), ActivationPolicy(ActivationsConfig(default_bits=16)))
    assert "forward" not in vars(norm)
    ActivationPacker(Holder("norm", norm), ActivationPolicy(ActivationsConfig(recompute_elementwise=False)))
    assert "forward" not in vars(norm)


def test_a_quantized_norm_stores_only_its_input():
    norm = Holder("norm", LlamaRMSNorm(256))
    packer = ActivationPacker(norm, ActivationPolicy(ActivationsConfig()))
    x = torch.randn(4, 256, requires_grad=True)
    with packer:
        out = norm(x * 1.0)
    cell = packer.accounting.total()
    assert (cell.tensors, cell.before) == (1, x.numel() * 4)
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and norm.norm.weight.grad.abs().sum() > 0


class MaskedProduct(torch.nn.Module):
    """x * mask with -inf in the mask (like SDPA's logsumexp on fully masked rows)."""

    def forward(self, x, mask):
        return x * mask


def test_tensors_with_infinities_inside_attention_are_kept_exact():
    """Without kept outliers a block holding -inf would come back all NaN: inside attention (where SDPA
    saves them) such a tensor is kept as saved. (With kept outliers the one -inf of a block is the
    block's outlier and comes back exact; see tests/ops/test_quant_api.py.)"""
    model = Holder("attn", MaskedProduct())
    model.forward = lambda x, mask: model.attn(x, mask)
    config = ActivationsConfig(keep_outliers=False, attention_bits=8)
    packer = ActivationPacker(model, ActivationPolicy(config))
    x = torch.randn(512, requires_grad=True)
    mask = torch.randn(512, requires_grad=True)
    masked = mask.detach().clone()
    masked[7] = -float("inf")
    masked.requires_grad_(True)
    with packer:
        out = model(x * 1.0, masked * 1.0)
    out.sum().backward()
    assert x.grad[7] == -float("inf")
    assert torch.equal(x.grad[torch.arange(512) != 7], masked.detach()[torch.arange(512) != 7])
    kept = [cell for cell in packer.accounting.by_kind().values()]
    assert sum(cell.after for cell in kept) > sum(cell.before for cell in kept) / 2  # the -inf one kept


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_with_the_default_policy(family):
    """The tiny preset of each supported family: gradients with the default policy (rewrites on where
    the family has gated MLPs and RMSNorms) stay within the int4 bound of the exact ones."""
    model = build_model("tiny", family, seed=0).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))

    def gradients(packer):
        model.zero_grad()
        with packer if packer else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    exact = gradients(None)
    packer = ActivationPacker(model, ActivationPolicy(ActivationsConfig()))
    found = gradients(packer)
    packer.remove()
    assert found.keys() == exact.keys()
    assert packer.accounting.total().after < packer.accounting.total().before / 2
    for name, cosine in cosines_by_name(found, exact).items():
        assert cosine >= TOLERANCES["activations_int4_grad_cosine"], (name, cosine)
