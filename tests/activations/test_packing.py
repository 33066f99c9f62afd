"""Saved-tensor packing (lazyzero/activations/packing.py) on a Llama decoder layer and small modules."""

import contextlib
import gc
import math
import weakref

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lazyzero.activations import ActivationPacker, ActivationPolicy
from lazyzero.activations import packing as packing_module
from lazyzero.activations.config import ActivationsConfig
from lazyzero.testing import TOLERANCES, HostReads, cosines_by_name

BATCH, SEQ, HIDDEN, HEADS, INTERMEDIATE = 2, 32, 64, 4, 172
HEAD_DIM = HIDDEN // HEADS
BLOCK = 64
POLICIES = {
    "all-16": ActivationsConfig(default_bits=16, attention_bits=16),
    "default": ActivationsConfig(),
    "mlp-4": ActivationsConfig(default_bits=4),
    "no-outliers": ActivationsConfig(keep_outliers=False),
    "default-packing-only": ActivationsConfig(recompute_elementwise=False),
    "all-8": ActivationsConfig(default_bits=8, attention_bits=8),
    "attention-input-exact": ActivationsConfig(attention_input_bits=16),
    "attention-input-4": ActivationsConfig(attention_input_bits=4, norm_bits=4),
    "default-norms-16": ActivationsConfig(norm_bits=16),
}


class OneLayerModel(torch.nn.Module):
    """One decoder layer under the name "layers.0", as in a real model, with its rotary embedding."""

    def __init__(self, seed: int):
        super().__init__()
        config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
                             num_hidden_layers=1, vocab_size=32)
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(config, layer_idx=0)])
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, hidden):
        positions = torch.arange(SEQ).expand(BATCH, -1)
        return self.layers[0](hidden, position_embeddings=self.rotary(hidden, positions))


def layer_gradients(model: OneLayerModel, config: ActivationsConfig | None, outlier: float = 0.0):
    """Gradients of every parameter (and of the layer's input) and the packer's accounting (None: exact).
    `outlier`: channel 7 of the input carries that value in every token, as a pretrained LLM's
    residual stream carries a few channels thousands of times larger than the rest."""
    model.zero_grad()
    generator = torch.Generator().manual_seed(1)
    leaf = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    if outlier:
        leaf[..., 7] = outlier
    leaf.requires_grad_()
    packer = ActivationPacker(model, ActivationPolicy(config)) if config else None
    if packer:
        with packer:
            out = model(leaf * 1.0)  # not a leaf, so the layer's input counts as an activation
        packer.remove()
    else:
        out = model(leaf * 1.0)
    (out * torch.randn(out.shape, generator=generator)).sum().backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return {**grads, "input": leaf.grad}, (packer.accounting if packer else None)


def packed_bytes(numel: int, bits: int, keep_outliers: bool) -> int:
    """int8: one byte per element; int4: two per byte; plus one fp32 scale per block, and with
    `keep_outliers` each block's largest value (fp32) and its index (one byte)."""
    codes = numel if bits == 8 else math.ceil(numel / 2)
    return codes + (4 + (5 if keep_outliers else 0)) * math.ceil(numel / BLOCK)


def channel_packed_bytes(numel: int, bits: int) -> int:
    """Bytes of an fp32 q or k of `numel` elements stored by channel (lazyzero/activations/by_channel.py):
    SEQ tokens padded to whole blocks, and per block an fp32 scale and an fp32 centre."""
    padded = numel // SEQ * (-(-SEQ // BLOCK) * BLOCK)
    return padded * bits // 8 + padded // BLOCK * 8


def expected_bytes(config: ActivationsConfig) -> dict:
    """(bytes before, bytes after, tensors) per kind for one Llama layer, counted by hand.

    What autograd saves (torch 2.13, transformers 5, SDPA), each storage once, parameters excluded:
    - each RMSNorm (2): its input [B,S,H] (pow and mul both save it), 1/rms [B,S,1] (rsqrt and mul),
      the normalized input [B,S,H] (the mul by the weight);
    - attention: the normed input [B,S,H] (q, k and v projections save views of the same storage),
      cos and sin [B,S,hd] (the rotary mul), q and k after rotation and v [B,heads,S,hd] (SDPA),
      SDPA's output [B,S,H] (o_proj saves a reshaped view of it) and logsumexp [B,heads,S];
    - MLP: its input [B,S,H] (gate and up projections), gate output [B,S,I] (SiLU), SiLU output and
      up output [B,S,I] (their mul), their product [B,S,I] (down projection).
    With `recompute_elementwise` (rewrites.py) a quantized norm saves only its input [B,S,H]; a
    quantized MLP does not keep the SiLU output and its product is a recipe (counted, 0 bytes after),
    and so is the input of the MLP or attention (the norm's output) where they store it no wider than
    the norm. Attention stores its input at the norm's width (or `attention_input_bits`), v and its
    output at `attention_value_bits` (or the MLP's width, where wider), q and k at `attention_bits` (or the
    MLP's width, where wider) in blocks along tokens padded to whole blocks (`channel_packed_bytes`), the
    rest of its tensors exact.
    """
    tokens = BATCH * SEQ
    bits = {"norm": max(config.default_bits, config.norm_bits), "mlp": config.default_bits, "attention": 16}
    attention_input = config.attention_input_bits or bits["norm"]
    input_bits = {"mlp": bits["mlp"], "attention": min(attention_input, bits["attention"])}
    value_bits = min(bits["attention"], max(bits["mlp"], config.attention_value_bits))
    query_key_bits = max(bits["mlp"], config.attention_bits)
    norm_rewritten = config.recompute_elementwise and bits["norm"] < 16
    mlp_rewritten = config.recompute_elementwise and bits["mlp"] < 16
    numels = {
        "norm": [tokens * HIDDEN] * 2 if norm_rewritten else [tokens * HIDDEN, tokens, tokens * HIDDEN] * 2,
        "attention": [tokens * HIDDEN] + [tokens * HEAD_DIM] * 2 + [tokens * HIDDEN] * 4 + [tokens * HEADS],
        # rewritten: input, gate, up, product (the SiLU output is not saved at all)
        "mlp": [tokens * HIDDEN] + [tokens * INTERMEDIATE] * (3 if mlp_rewritten else 4),
    }
    recipes = {"mlp": {3} if mlp_rewritten else set(), "attention": set()}  # the product
    for kind in ("mlp", "attention"):  # the input: the norm's output, rebuilt from the norm's stored input
        if norm_rewritten and input_bits[kind] <= bits["norm"]:
            recipes[kind].add(0)
    expected = {}
    for kind, sizes in numels.items():
        before = sum(4 * n for n in sizes)  # fp32
        widths = [input_bits[kind] if i == 0 and kind in input_bits else bits[kind] for i in range(len(sizes))]
        by_channel = set()
        if kind == "attention":
            widths[3:7] = [query_key_bits] * 2 + [value_bits] * 2  # q and k, v and the output
            by_channel = {3, 4} if query_key_bits < 16 else set()
        after = sum(0 if i in recipes.get(kind, ()) else 4 * n if width == 16
                    else channel_packed_bytes(n, width) if i in by_channel
                    else packed_bytes(n, width, config.keep_outliers)
                    for i, (n, width) in enumerate(zip(sizes, widths)))
        expected[kind] = (before, after, len(sizes))
    return expected


@pytest.fixture(scope="module")
def exact_gradients():
    return layer_gradients(OneLayerModel(seed=0), None)[0]


@pytest.mark.parametrize("policy", POLICIES)
def test_bytes_saved_per_layer_match_the_analytic_count(policy):
    _, accounting = layer_gradients(OneLayerModel(seed=0), POLICIES[policy])
    found = {kind: (cell.before, cell.after, cell.tensors) for kind, cell in accounting.by_kind().items()}
    assert found == expected_bytes(POLICIES[policy])
    layer = accounting.by_layer()
    assert list(layer) == [0]
    assert (layer[0].before, layer[0].after) == (accounting.total().before, accounting.total().after)


@pytest.mark.parametrize("policy, bound", [("all-8", "activations_int8_grad_cosine"),
                                           ("default", "activations_int8_grad_cosine"),
                                           ("mlp-4", "activations_int4_grad_cosine")])
def test_gradients_with_packed_activations_stay_close_to_exact(exact_gradients, policy, bound):
    grads, _ = layer_gradients(OneLayerModel(seed=0), POLICIES[policy])
    found = cosines_by_name(grads, exact_gradients)
    assert min(found.values()) >= TOLERANCES[bound], found
    # The quantization error is real: an unquantized run would give cosines of exactly 1.
    assert min(found.values()) < 1 - 1e-6


def model_with_a_massive_channel() -> OneLayerModel:
    """Norm weights that scale channel 7 down by its magnitude, as a pretrained model's do, so that the
    other channels still carry the layer's signal."""
    model = OneLayerModel(seed=0)
    for norm in (model.layers[0].input_layernorm, model.layers[0].post_attention_layernorm):
        norm.weight.data[7] = 1 / 3000
    return model


def test_a_massive_channel_costs_the_rest_of_its_block_nothing():
    """Channel 7 at 3000 (typical values are about 1): an 8-bit block scaled by it rounds every other
    value of the block to zero, unless the block's largest value is kept exact."""
    exact, _ = layer_gradients(model_with_a_massive_channel(), None, outlier=3000.0)
    kept, _ = layer_gradients(model_with_a_massive_channel(), ActivationsConfig(), outlier=3000.0)
    lost, _ = layer_gradients(model_with_a_massive_channel(), ActivationsConfig(keep_outliers=False), outlier=3000.0)
    assert min(cosines_by_name(kept, exact).values()) >= TOLERANCES["activations_int8_grad_cosine"]
    assert min(cosines_by_name(lost, exact).values()) < TOLERANCES["activations_int4_grad_cosine"]


def test_all_16_policy_gives_exact_gradients(exact_gradients):
    grads, _ = layer_gradients(OneLayerModel(seed=0), POLICIES["all-16"])
    for name, grad in exact_gradients.items():
        torch.testing.assert_close(grads[name], grad, atol=0, rtol=0)


@pytest.fixture
def quantized_inputs(monkeypatch):
    """Every tensor the packer quantizes, with its width."""
    seen = []
    original = packing_module.quantize_blockwise

    def spy(x, bits, **kwargs):
        seen.append((x, bits))
        return original(x, bits, **kwargs)

    monkeypatch.setattr(packing_module, "quantize_blockwise", spy)
    return seen


def test_parameters_are_never_packed(quantized_inputs):
    model = OneLayerModel(seed=0)
    layer_gradients(model, POLICIES["all-8"])
    parameter_storages = {param.untyped_storage().data_ptr() for param in model.parameters()}
    assert quantized_inputs and all(x.untyped_storage().data_ptr() not in parameter_storages
                                    for x, _ in quantized_inputs)


class SavesDetachedWeight(torch.nn.Module):
    """x * weight.detach(): a tensor sharing the parameter's storage without being a view of it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(BLOCK * 2), requires_grad=False)

    def forward(self, x):
        return x * self.weight.detach()


def packer_for(module, overrides: dict) -> ActivationPacker:
    """A packer for `module` named "block" in its model (the root's empty name cannot be overridden)."""
    model = torch.nn.ModuleDict({"block": module})
    return ActivationPacker(model, ActivationPolicy(ActivationsConfig(overrides=overrides)))


def forward_packed(module, bits, x):
    """module(x) with its saved tensors packed at `bits` (read them back through out.grad_fn._saved_*)."""
    packer = packer_for(module, {"block": bits})
    with packer:
        out = module(x)
    packer.remove()
    return out


def test_storage_shared_with_a_parameter_is_kept():
    module = SavesDetachedWeight()
    x = torch.randn(BLOCK * 2).requires_grad_() * 1.0
    out = forward_packed(module, 4, x)
    assert out.grad_fn._saved_other.data_ptr() == module.weight.data_ptr()


class IntegerAndBoolSaves(torch.nn.Module):
    def forward(self, x, index, mask):
        return torch.gather(x, 0, index) + torch.where(mask, x, 0.0)


def test_integer_and_bool_saved_tensors_are_untouched(quantized_inputs):
    x = torch.randn(BLOCK * 4).requires_grad_() * 1.0
    index = torch.randint(0, BLOCK * 4, (BLOCK * 4,))
    mask = torch.rand(BLOCK * 4) > 0.5
    module = IntegerAndBoolSaves()
    with packer_for(module, {"block": 4}):
        out = module(x, index, mask)
    gather_backward, where_backward = out.grad_fn.next_functions[0][0], out.grad_fn.next_functions[1][0]
    assert gather_backward._saved_index.data_ptr() == index.data_ptr()
    assert where_backward._saved_condition.data_ptr() == mask.data_ptr()
    assert all(x.dtype.is_floating_point for x, _ in quantized_inputs)


class Sine(torch.nn.Module):
    """sin saves its input; an optional child runs before it."""

    def __init__(self, child: torch.nn.Module | None = None):
        super().__init__()
        self.child = child if child is not None else torch.nn.Identity()
        self.last_input = None

    def forward(self, x):
        h = self.child(x) * 2.0
        self.last_input = weakref.ref(h)
        return torch.sin(h)


def test_tensors_smaller_than_a_block_are_kept(quantized_inputs):
    x = torch.randn(BLOCK - 1).requires_grad_() * 1.0
    module = Sine()
    out = forward_packed(module, 4, x)
    assert out.grad_fn._saved_self.data_ptr() == module.last_input().data_ptr() and quantized_inputs == []


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_no_copy_of_a_packed_tensor_is_kept(bits):
    module = Sine()
    leaf = torch.randn(BLOCK * 8, requires_grad=True)
    with packer_for(module, {"block": bits}):
        out = module(leaf * 1.0)
    gc.collect()
    # 16 bits: autograd holds the input of sin itself; packed: only its codes, so it is freed.
    assert (module.last_input() is not None) == (bits == 16)
    out.sum().backward()  # d sin(2x) / dx = 2 cos(2x), from the unpacked input
    cosine = torch.nn.functional.cosine_similarity(leaf.grad, 2 * torch.cos(2 * leaf.detach()), dim=0)
    bound = TOLERANCES["activations_int4_grad_cosine" if bits == 4 else "activations_int8_grad_cosine"]
    assert cosine >= bound


@pytest.mark.parametrize("outer_bits, inner_bits", [(8, 4), (4, 8), (4, 16), (16, 4)])
def test_nested_modules_use_the_innermost_width(quantized_inputs, outer_bits, inner_bits):
    module = Sine(child=Sine())
    x = torch.randn(BLOCK * 8).requires_grad_() * 1.0
    with packer_for(module, {"block.child": inner_bits, "block": outer_bits}):
        module(x)
    expected = [bits for bits in (inner_bits, outer_bits) if bits != 16]
    # The inner module saves first (its sin runs inside the outer forward), then the outer one.
    assert [bits for _, bits in quantized_inputs] == expected


class Fails(torch.nn.Module):
    def forward(self, x):
        raise ValueError("boom")


def test_a_failing_forward_leaves_no_module_running(quantized_inputs):
    module = Fails()
    packer = packer_for(module, {"block": 4})
    x = torch.randn(BLOCK * 8).requires_grad_() * 1.0
    with pytest.raises(ValueError, match="boom"), packer:
        module(x)
    with packer:
        torch.sin(x)  # outside every module: kept, unless the failed module were still on the stack
    assert quantized_inputs == []


def test_a_recipe_is_rebuilt_once_for_all_the_nodes_that_read_it(monkeypatch):
    """The q, k and v projections all read the attention's input, gate and up the MLP's: each of
    those recipes (the norms' outputs) and the MLP's product is rebuilt once in backward, not per node."""
    from lazyzero.activations.stored import DerivedStorage

    rebuilt = []
    original = DerivedStorage.materialize

    def counting(self):
        rebuilt.append(self)
        return original(self)

    monkeypatch.setattr(DerivedStorage, "materialize", counting)
    grads, _ = layer_gradients(OneLayerModel(seed=0), POLICIES["default"])
    assert len(rebuilt) == len({id(recipe) for recipe in rebuilt}) == 3
    rebuilt.clear()
    monkeypatch.setattr(DerivedStorage, "materialize_for_autograd", DerivedStorage.materialize)
    unshared, _ = layer_gradients(OneLayerModel(seed=0), POLICIES["default"])
    assert len(rebuilt) == 3 + 2 + 1  # per node without the sharing; the same gradients either way
    for name, grad in grads.items():
        torch.testing.assert_close(unshared[name], grad, rtol=0, atol=0)


def _host_reads_in_forward(config: ActivationsConfig | None) -> int:
    """How many times one forward of `OneLayerModel` (packed under `config`, plain when None) reads a
    tensor's value back to the host (`HostReads`)."""
    model = OneLayerModel(seed=0)
    leaf = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    packer = ActivationPacker(model, ActivationPolicy(config)) if config else None
    with HostReads("cpu") as reads, packer if packer else contextlib.nullcontext():
        model(leaf * 1.0)
    return reads.count


def test_the_default_policy_reads_nothing_back_to_the_host():
    """A read per stored tensor (the look for blocks that are not finite) makes a GPU's host wait for
    every queued kernel; it more than doubled an H200's step (docs/activations.md). Under the default
    policy nothing quantized is looked at: the logsumexp, where infinities can be, stays exact (q and k
    are finite in a finite forward). With the whole attention at 8 bits (an override) its tensors are
    looked at, which shows that `HostReads` sees such reads."""
    plain = _host_reads_in_forward(None)
    assert _host_reads_in_forward(ActivationsConfig()) == plain
    assert _host_reads_in_forward(ActivationsConfig(overrides={"*.self_attn": 8})) > plain
