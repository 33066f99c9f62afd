"""Saved-activation packing on CUDA (the CUDA quantization kernels under the packer).

Marked `gpu`: skipped on machines without a CUDA device. A Llama decoder layer in bf16 on the GPU:
the bytes stored per kind equal the CPU's for the same policy (same tensors, same block layout), and
the gradients with packed activations keep the cosine bounds that hold on the CPU.

CUDA's attention kernels save a few tensors the CPU's do not (their random-number state: two int64
scalars). The packer keeps such small tensors whole, so they add the same bytes to what is saved and
to what is stored; everything quantized must match the CPU byte for byte.
"""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lazyzero.activations import ActivationPacker, ActivationPolicy
from lazyzero.activations.config import ActivationsConfig
from lazyzero.testing import TOLERANCES, HostReads, cosines_by_name

pytestmark = pytest.mark.gpu
BATCH, SEQ, HIDDEN = 2, 128, 256
POLICIES = {"default": ("activations_int4_grad_cosine", ActivationsConfig()),
            "all-8": ("activations_int8_grad_cosine", ActivationsConfig(default_bits=8, attention_bits=8))}
MAX_CUDA_ONLY_SAVED_BYTES = 64  # a few scalars (see the module docstring); a quantized tensor is far larger


class OneLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4, intermediate_size=688, vocab_size=32)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden):
        positions = torch.arange(SEQ, device=hidden.device).expand(BATCH, -1)
        return self.layers[0](hidden, position_embeddings=self.rotary(hidden, positions))


def run(device: str, config: ActivationsConfig | None):
    model = OneLayer().to(device=device, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    leaf = torch.randn(BATCH, SEQ, HIDDEN, generator=generator).to(device, torch.bfloat16).requires_grad_(True)
    weights = torch.randn(BATCH, SEQ, HIDDEN, generator=generator).to(device, torch.bfloat16)
    packer = ActivationPacker(model, ActivationPolicy(config)) if config else None
    with packer if packer else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        out = model(leaf * 1.0)
    (out.float() * weights.float()).sum().backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters()}
    by_kind = {kind: (c.before, c.after) for kind, c in packer.accounting.by_kind().items()} if packer else None
    return grads, by_kind


@pytest.mark.parametrize("policy", POLICIES)
def test_packing_on_cuda_stores_what_the_cpu_stores_and_keeps_gradients_close(policy):
    bound, config = POLICIES[policy]
    exact, _ = run("cuda", None)
    grads, by_kind = run("cuda", config)
    _, cpu_by_kind = run("cpu", config)
    assert by_kind.keys() == cpu_by_kind.keys()
    for kind, (saved, stored) in by_kind.items():
        cpu_saved, cpu_stored = cpu_by_kind[kind]
        extra_kept_whole = saved - cpu_saved
        assert 0 <= extra_kept_whole <= MAX_CUDA_ONLY_SAVED_BYTES, (kind, saved, cpu_saved)
        assert stored - cpu_stored == extra_kept_whole, (kind, stored, cpu_stored)
    for name, cosine in cosines_by_name(grads, exact).items():
        assert cosine >= TOLERANCES[bound], (name, cosine)


def _host_reads_in_forward(config: ActivationsConfig | None) -> int:
    """How many times one forward of `OneLayer` on CUDA (packed under `config`, plain when None) reads a
    CUDA tensor's value back to the host (`HostReads`)."""
    model = OneLayer().to(device="cuda", dtype=torch.bfloat16)
    leaf = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    packer = ActivationPacker(model, ActivationPolicy(config)) if config else None
    with HostReads("cuda") as reads:
        with packer if packer else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            model(leaf * 1.0)
    return reads.count


def test_packing_on_cuda_never_makes_the_host_wait():
    """A read per stored tensor keeps the host from queueing work ahead of the GPU (it more than doubled
    an H200's step time: docs/activations.md); the default policy's forward reads no more than the
    plain one (as tests/activations/test_packing.py asserts on the CPU). Nor does the whole attention at
    8 bits, whose tensors are looked at for non-finite blocks: on CUDA that look is read once, when the
    forward ends, as one copy (lazyzero/activations/finite_checks.py), not per tensor."""
    plain = _host_reads_in_forward(None)
    assert _host_reads_in_forward(ActivationsConfig()) == plain
    assert _host_reads_in_forward(ActivationsConfig(overrides={"*.self_attn": 8})) == plain
