"""AttentionRoles: which saved tensors are an attention's values (lazyzero/activations/attention_values.py)."""

import pytest
import torch
import torch.nn.functional as F

from lazyzero.activations import ActivationPacker, ActivationPolicy
from lazyzero.activations.attention_values import AttentionRoles
from lazyzero.activations.config import ActivationsConfig
from lazyzero.models.build import build_model


def _saved_roles(dtype: torch.dtype) -> list[tuple[str, bool, bool]]:
    """(what each tensor saved around and inside SDPA is, whether AttentionRoles calls it a value, and the
    query or key), in the order they are saved; "output" is a tensor of the query's size that is none of
    q, k, v."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=generator, dtype=dtype).requires_grad_() for _ in range(3))
    projection = torch.nn.Linear(64, 64, dtype=dtype)
    names = {id(q): "q", id(k): "k", id(v): "v"}
    roles, seen = AttentionRoles(), []

    def pack(tensor):
        root = tensor if tensor._base is None else tensor._base
        if isinstance(root, torch.nn.Parameter):
            return tensor  # the packer keeps parameters and their views before it asks for roles
        output = tensor.dtype == dtype and tensor.numel() == q.numel()
        name = names.get(id(root), "output" if output else "other")
        seen.append((name, roles.is_value(tensor), roles.is_query_or_key(tensor)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), roles:
        query = torch.sin(q)  # saves q, before the attention call
        names[id(query)] = "query"
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True)
        projection(out.transpose(1, 2).reshape(2, 64, 64))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_and_output_are_values_and_what_rebuilds_the_softmax_is_not(dtype):
    seen = [(name, is_value) for name, is_value, _ in _saved_roles(dtype)]
    assert seen[0] == ("q", False)
    assert ("query", False) in seen and ("k", False) in seen and ("v", True) in seen
    assert seen[-1] == ("output", True)  # the projection's input, a view of the attention's output
    assert all(not is_value for name, is_value in seen if name in ("q", "query", "k", "other"))  # and the logsumexp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_query_and_key_of_the_running_call_are_query_or_key(dtype):
    found = {(name, is_query_or_key) for name, _, is_query_or_key in _saved_roles(dtype)}
    assert ("query", True) in found and ("k", True) in found
    # q before the call (sin saves it), v, the output, the logsumexp ("other"): not
    assert {name for name, is_query_or_key in found if not is_query_or_key} == {"q", "v", "output", "other"}


def test_nothing_is_a_value_outside_an_sdpa_call():
    roles = AttentionRoles()
    with roles:
        assert not roles.is_value(torch.ones(4)) and not roles.is_query_or_key(torch.ones(4))


def _attention_stored_bytes(implementation: str, config: ActivationsConfig) -> int:
    torch.manual_seed(0)
    model = build_model("tiny", "llama")
    model.config._attn_implementation = implementation
    packer = ActivationPacker(model, ActivationPolicy(config))
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with packer:
        model(input_ids=ids, labels=ids).loss.backward()
    packer.remove()
    return packer.accounting.by_kind()["attention"].after


def test_values_are_found_under_sdpa_and_eager_attention_keeps_them_exact():
    """Without an SDPA call the roles cannot be told apart: the whole attention stays exact."""
    exact_values = ActivationsConfig(enabled=True, attention_value_bits=16)
    default = ActivationsConfig(enabled=True)
    assert _attention_stored_bytes("sdpa", default) < 0.8 * _attention_stored_bytes("sdpa", exact_values)
    assert _attention_stored_bytes("eager", default) == _attention_stored_bytes("eager", exact_values)


def test_no_kv_cache_is_built_for_training_under_the_packer():
    """The cache would hold every layer's k and v unpacked until the forward pass returns."""
    torch.manual_seed(0)
    model = build_model("tiny", "llama")
    assert model.config.use_cache
    packer = ActivationPacker(model, ActivationPolicy(ActivationsConfig(enabled=True)))
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with packer:
        assert model(input_ids=ids, labels=ids).past_key_values is None
        assert model(input_ids=ids, use_cache=True).past_key_values is not None  # asked for: kept
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None  # evaluation and generation: unchanged
    packer.remove()
