"""Saved-activation packing on CUDA (the CUDA quantization kernels under the packer).

Marked `gpu`: skipped on machines without a CUDA device. A Llama decoder layer in bf16 on the GPU:
the bytes stored per kind equal the CPU's for the same policy (same tensors, same block layout), and
the gradients with packed activations keep the cosine bounds that hold on the CPU.
"""

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lazyzero.activations import ActivationPacker, ActivationPolicy
from lazyzero.config.models import ActivationsConfig
from lazyzero.testing import TOLERANCES, cosines_by_name

pytestmark = pytest.mark.gpu
BATCH, SEQ, HIDDEN = 2, 128, 256
POLICIES = {"default": ("activations_int4_grad_cosine", ActivationsConfig()),
            "all-8": ("activations_int8_grad_cosine", ActivationsConfig(default_bits=8, attention_bits=8))}


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
    assert by_kind == cpu_by_kind
    for name, cosine in cosines_by_name(grads, exact).items():
        assert cosine >= TOLERANCES[bound], (name, cosine)
