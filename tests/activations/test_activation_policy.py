"""Which width each module's saved activations get (lazyzero/activations/policy.py, stages.py)."""

import functools

import pytest
import torch

from lazyzero.activations import (
    ActivationPolicy,
    classify_module,
    layer_index,
    one_f_one_b_in_flight,
    pipeline_stage_bits,
)
from lazyzero.activations.config import ActivationsConfig
from lazyzero.models import build_model

LLAMA_LIKE_NAMES = {
    "model.layers.1.self_attn": "attention",
    "model.layers.1.mlp": "mlp",
    "model.layers.1.input_layernorm": "norm",
    "model.layers.1.post_attention_layernorm": "norm",
    "model.norm": "norm",
    "model.layers.1": "other",
    "model.layers.1.self_attn.q_proj": "other",
    "model.layers.1.mlp.act_fn": "other",
    "model.embed_tokens": "other",
    "lm_head": "other",
}
GPT2_NAMES = {
    "transformer.h.1.attn": "attention",
    "transformer.h.1.attn.c_attn": "other",
    "transformer.h.1.mlp": "mlp",
    "transformer.h.1.ln_1": "norm",
    "transformer.h.1.ln_2": "norm",
    "transformer.ln_f": "norm",
    "transformer.h.1": "other",
    "transformer.wte": "other",
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "gpt2"])
def tiny_model(request):
    return request.param, build_model("tiny", request.param, meta=True)


def test_modules_of_every_family_are_classified_by_class(tiny_model):
    family, model = tiny_model
    expected = GPT2_NAMES if family == "gpt2" else LLAMA_LIKE_NAMES
    modules = dict(model.named_modules())
    assert {name: classify_module(name, modules[name]) for name in expected} == expected


class Mixer(torch.nn.Module):
    """A module class no family uses: classified by its name only."""


def test_unknown_classes_fall_back_to_name_patterns():
    assert classify_module("blocks.0.attn", Mixer()) == "attention"
    assert classify_module("blocks.0.self_attention", Mixer()) == "attention"
    assert classify_module("blocks.0.ffn", Mixer()) == "mlp"
    assert classify_module("blocks.0.final_norm", Mixer()) == "norm"
    assert classify_module("blocks.0.mixer", Mixer()) == "other"
    # A plain Linear named like attention stays a building block of whatever surrounds it.
    assert classify_module("blocks.0.attn_out", torch.nn.Linear(2, 2)) == "other"


def test_layer_index_from_module_names():
    assert layer_index("model.layers.12.mlp.up_proj") == 12
    assert layer_index("transformer.h.3") == 3
    assert layer_index("layers.0") == 0
    assert layer_index("model.norm") is None
    assert layer_index("model.my_layers.2") is None


def test_default_policy_keeps_attention_and_stores_the_rest_at_8_bits():
    plan = ActivationPolicy(ActivationsConfig()).plan(build_model("tiny", "llama", meta=True))
    bits = {entry.name: entry.bits for entry in plan}
    assert bits["model.layers.0.self_attn"] == 16
    assert bits["model.layers.0.input_layernorm"] == bits["model.norm"] == 8
    assert bits["model.layers.0.mlp"] == 8
    assert bits["model.layers.1"] == 8
    four = ActivationPolicy(ActivationsConfig(default_bits=4)).plan(build_model("tiny", "llama", meta=True))
    bits = {entry.name: entry.bits for entry in four}
    assert bits["model.layers.0.mlp"] == bits["model.layers.1"] == 4 and bits["model.norm"] == 8
    # Building blocks inherit from the module around them, so they are not in the plan.
    assert "model.layers.0.mlp.up_proj" not in bits and "model.embed_tokens" not in bits
    assert [entry.layer for entry in plan if entry.name.startswith("model.layers.1")] == [1] * 5


def test_rules_apply_in_order_recompute_override_attention_planner_default():
    config = ActivationsConfig(
        default_bits=4, attention_bits=8, norm_bits=4, recompute_layers=[2],
        overrides={"model.layers.1.*": 16, "model.layers.*.mlp": 8, "model.layers.2.*": 4},
    )  # fmt: skip
    policy = ActivationPolicy(config).with_layer_bits({0: 16, 3: 8})
    assert policy.bits_for("model.layers.2.mlp", "mlp", 2) == 16  # recomputed beats every override
    assert policy.bits_for("model.layers.1.mlp", "mlp", 1) == 16  # first matching pattern wins
    assert policy.bits_for("model.layers.3.mlp", "mlp", 3) == 8  # override
    # The planner leaves attention, kept exact apart from its query, key and values (their own widths).
    assert policy.bits_for("model.layers.0.self_attn", "attention", 0) == 16
    assert policy.bits_for("model.layers.0.input_layernorm", "norm", 0) == 16  # planner
    assert policy.bits_for("model.layers.3.input_layernorm", "norm", 3) == 8  # planner
    assert policy.bits_for("model.layers.4.input_layernorm", "norm", 4) == 4  # default (norm_bits 8 by default)
    assert policy.bits_for("model.norm", "norm", None) == 4
    norms_at_8 = ActivationPolicy(ActivationsConfig(norm_bits=8, default_bits=4)).with_layer_bits({0: 16})
    assert norms_at_8.bits_for("model.layers.1.input_layernorm", "norm", 1) == 8  # norm_bits over default 4
    assert norms_at_8.bits_for("model.layers.0.input_layernorm", "norm", 0) == 16  # a wider layer width wins
    assert norms_at_8.bits_for("model.layers.1.mlp", "mlp", 1) == 4  # only norms


def attention_widths(field: str, config: ActivationsConfig, layer_bits: dict | None = None) -> dict:
    """Each decoder layer's attention `field` (a `ModuleBits` width) under `config` and planned `layer_bits`."""
    policy = ActivationPolicy(config).with_layer_bits(layer_bits or {})
    plan = policy.plan(build_model("tiny", "llama", meta=True))
    return {entry.layer: getattr(entry, field) for entry in plan if entry.kind == "attention"}


input_widths = functools.partial(attention_widths, "input_bits")
query_key_widths = functools.partial(attention_widths, "query_key_bits")
value_widths = functools.partial(attention_widths, "value_bits")


def test_attention_stores_its_input_like_the_norm_before_it():
    assert input_widths(ActivationsConfig()) == {0: 8, 1: 8}  # the layers' norms: norm_bits
    assert input_widths(ActivationsConfig(attention_input_bits=16)) == {0: None, 1: None}  # kept exact
    assert input_widths(ActivationsConfig(attention_input_bits=4)) == {0: 4, 1: 4}
    assert input_widths(ActivationsConfig(recompute_layers=[1])) == {0: 8, 1: None}  # norms at 16 there
    assert input_widths(ActivationsConfig(), {0: 16}) == {0: None, 1: 8}  # a 16-bit planned layer
    # An override of a whole layer reaches its norms, and so the attention's input.
    assert input_widths(ActivationsConfig(overrides={"model.layers.1.*": 16})) == {0: 8, 1: None}
    assert input_widths(ActivationsConfig(norm_bits=16)) == {0: None, 1: None}
    assert input_widths(ActivationsConfig(attention_bits=8, norm_bits=4, default_bits=4)) == {0: 4, 1: 4}


def test_query_and_key_keep_attention_bits_unless_their_layer_is_kept_whole():
    assert query_key_widths(ActivationsConfig()) == {0: 8, 1: 8}
    assert query_key_widths(ActivationsConfig(default_bits=4)) == {0: 8, 1: 8}  # never below attention_bits
    assert query_key_widths(ActivationsConfig(attention_bits=16)) == {0: None, 1: None}
    assert query_key_widths(ActivationsConfig(), {0: 16}) == {0: None, 1: 8}  # a 16-bit planned layer
    assert query_key_widths(ActivationsConfig(recompute_layers=[1])) == {0: 8, 1: None}
    assert query_key_widths(ActivationsConfig(overrides={"*.self_attn": 8})) == {0: None, 1: None}  # the override's


def test_attention_values_take_their_own_width_where_the_layer_is_quantized():
    assert value_widths(ActivationsConfig()) == {0: 8, 1: 8}
    assert value_widths(ActivationsConfig(default_bits=4)) == {0: 8, 1: 8}  # never below attention_value_bits
    assert value_widths(ActivationsConfig(attention_value_bits=16)) == {0: None, 1: None}
    assert value_widths(ActivationsConfig(default_bits=16)) == {0: None, 1: None}  # a 16-bit layer keeps them
    assert value_widths(ActivationsConfig(), {0: 16}) == {0: None, 1: 8}  # a 16-bit planned layer
    assert value_widths(ActivationsConfig(recompute_layers=[1])) == {0: 8, 1: None}
    # An override naming the attention sets all of it; one naming the MLP sets the layer's width.
    assert value_widths(ActivationsConfig(overrides={"*.self_attn": 8})) == {0: None, 1: None}
    assert value_widths(ActivationsConfig(overrides={"model.layers.1.*": 16})) == {0: 8, 1: None}
    assert value_widths(ActivationsConfig(default_bits=16, overrides={"model.layers.1.mlp": 8})) == {0: None, 1: 8}


def test_overrides_make_any_module_set_a_width():
    config = ActivationsConfig(overrides={"model.layers.0.mlp.down_proj": 8})
    plan = ActivationPolicy(config).plan(build_model("tiny", "llama", meta=True))
    assert [(e.name, e.kind, e.bits) for e in plan if e.name.endswith("down_proj")] == [
        ("model.layers.0.mlp.down_proj", "other", 8)
    ]


@pytest.mark.parametrize("layer_bits", [{0: 5}, {-1: 4}, {True: 4}, {"0": 8}])
def test_planner_widths_are_checked(layer_bits):
    with pytest.raises(ValueError):
        ActivationPolicy(ActivationsConfig()).with_layer_bits(layer_bits)


def test_with_layer_bits_returns_a_new_policy():
    policy = ActivationPolicy(ActivationsConfig())
    planned = policy.with_layer_bits({1: 8})
    assert planned.layer_bits == {1: 8} and policy.layer_bits == {}


def test_one_f_one_b_in_flight_counts():
    assert one_f_one_b_in_flight(4) == [4, 3, 2, 1]
    assert one_f_one_b_in_flight(4, micro_batches=2) == [2, 2, 2, 1]
    assert one_f_one_b_in_flight(1) == [1]
    with pytest.raises(ValueError):
        one_f_one_b_in_flight(0)


def test_stages_holding_more_micro_batches_get_fewer_bits():
    assert pipeline_stage_bits([4, 3, 2, 1], base_bits=4) == [4, 4, 8, 16]
    assert pipeline_stage_bits([4, 3, 2, 1], base_bits=8) == [8, 8, 16, 16]
    assert pipeline_stage_bits([8, 7, 6, 5, 4, 3, 2, 1], base_bits=4) == [4, 4, 4, 4, 8, 8, 16, 16]
    assert pipeline_stage_bits([2, 2, 2, 1], base_bits=4) == [4, 4, 4, 8]
    assert pipeline_stage_bits([3], base_bits=8) == [8]


@pytest.mark.parametrize("stages", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("base_bits", [4, 8])
def test_no_stage_needs_more_memory_than_the_busiest_and_widths_never_decrease(stages, base_bits):
    in_flight = one_f_one_b_in_flight(stages)
    bits = pipeline_stage_bits(in_flight, base_bits)
    assert bits[0] == base_bits and bits == sorted(bits)
    assert max(count * width for count, width in zip(in_flight, bits)) == in_flight[0] * base_bits


@pytest.mark.parametrize("in_flight, base_bits", [([], 4), ([2, 0], 4), ([2, 1], 6)])
def test_stage_rule_rejects_bad_inputs(in_flight, base_bits):
    with pytest.raises(ValueError):
        pipeline_stage_bits(in_flight, base_bits)
