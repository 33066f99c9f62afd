"""Model presets, configs from paths, building, and analytic parameter counts."""

import json
import re
import time

import pytest
import torch

from lazyzero.app.data import ByteTokenizer
from lazyzero.models import FAMILIES, PRESETS, build_model, count_parameters, model_config

NOMINAL_SIZES = {"125m": 125e6, "1b": 1e9, "7b": 7e9, "13b": 13e9, "27b": 27e9}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_runs_forward_and_backward(family):
    model = build_model("tiny", family)
    input_ids = torch.randint(0, ByteTokenizer.vocab_size, (2, 16))
    out = model(input_ids=input_ids, labels=input_ids)
    assert out.logits.shape == (2, 16, ByteTokenizer.vocab_size)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.config.model_type == family


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", ["tiny", "demo"])
def test_count_parameters_matches_the_built_model(family, preset):
    model = build_model(preset, family)
    assert count_parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_count_parameters_matches_meta_models_of_large_presets():
    model = build_model("7b", "qwen2", meta=True)
    assert next(model.parameters()).is_meta
    assert count_parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_preset_sizes_are_close_to_their_names():
    assert 20e6 * 0.85 <= count_parameters(model_config("demo")) <= 20e6 * 1.15
    assert count_parameters(model_config("tiny")) <= 1e6
    for name, nominal in NOMINAL_SIZES.items():
        count = count_parameters(model_config(name))
        assert nominal * 0.85 <= count <= nominal * 1.15, (name, count)
        assert model_config(name).vocab_size == 32000


def test_large_configs_are_created_without_allocating_weights():
    start = time.perf_counter()
    for name in ("7b", "13b", "27b"):
        for family in FAMILIES:
            model_config(name, family)
    assert time.perf_counter() - start < 2.0


def test_preset_dims_map_onto_every_family():
    preset = PRESETS["demo"]
    for family in FAMILIES:
        config = model_config("demo", family, vocab_size=300, max_positions=128)
        assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
            preset.hidden, preset.layers, preset.heads
        )  # fmt: skip
        assert (config.vocab_size, config.max_position_embeddings) == (300, 128)
    assert model_config("demo", "gpt2").n_inner == preset.intermediate
    assert model_config("tiny", "mistral").num_key_value_heads == PRESETS["tiny"].kv_heads
    assert model_config("demo").tie_word_embeddings is False


def test_same_seed_same_weights_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    first, again, other = build_model("tiny", seed=7), build_model("tiny", seed=7), build_model("tiny", seed=8)
    assert torch.equal(torch.random.get_rng_state(), state)
    pairs = list(zip(first.parameters(), again.parameters(), other.parameters()))
    assert all(torch.equal(a, b) for a, b, _ in pairs)
    assert not all(torch.equal(a, c) for a, _, c in pairs)


def test_dtype_is_applied():
    assert next(build_model("tiny", dtype=torch.bfloat16).parameters()).dtype == torch.bfloat16


def test_demo_model_builds_in_seconds():
    start = time.perf_counter()
    build_model("demo")
    assert time.perf_counter() - start < 10.0


def test_config_json_path_and_config_only_folder(tmp_path):
    model_config("tiny", "qwen2").save_pretrained(tmp_path)
    for spec in (str(tmp_path / "config.json"), str(tmp_path)):
        config = model_config(spec, vocab_size=512, max_positions=64)
        assert config.model_type == "qwen2"
        assert (config.vocab_size, config.max_position_embeddings, config.hidden_size) == (512, 64, 64)
        assert build_model(spec).config.model_type == "qwen2"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_checkpoint_folder_reloads_the_same_weights(tmp_path, family):
    model = build_model("tiny", family, seed=3)
    model.save_pretrained(tmp_path)
    reloaded = build_model(str(tmp_path), vocab_size=ByteTokenizer.vocab_size)
    original, loaded = model.state_dict(), reloaded.state_dict()
    assert original.keys() == loaded.keys()
    assert all(torch.equal(original[k], loaded[k]) for k in original)


def test_checkpoint_folder_must_cover_the_tokenizer_and_positions(tmp_path):
    build_model("tiny").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"checkpoint {re.escape(str(tmp_path))} has a vocabulary of 259 tokens"):
        model_config(str(tmp_path), vocab_size=300)
    with pytest.raises(ValueError, match="supports 256 positions, fewer than the requested 1024"):
        model_config(str(tmp_path), max_positions=1024)
    assert model_config(str(tmp_path), vocab_size=100).vocab_size == 259


def test_unknown_preset_lists_presets_and_mentions_paths():
    with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*tiny, demo, 125m.*path"):
        model_config("huge")


def test_path_errors_name_the_file(tmp_path):
    missing = tmp_path / "missing" / "config.json"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        model_config(str(missing))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "config.json"))):
        model_config(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"{re.escape(str(bad))} is not valid JSON"):
        model_config(str(bad))
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="must be a JSON object with a 'model_type' field"):
        model_config(str(bad))
    bad.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert'; supported families: llama, qwen2, mistral, gpt2"):
        model_config(str(bad))


def test_family_errors():
    with pytest.raises(ValueError, match="unknown model family 'opt'"):
        model_config("tiny", "opt")


def test_family_that_disagrees_with_the_file_is_an_error(tmp_path):
    model_config("tiny", "gpt2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"family 'llama' was requested but .*config.json describes a 'gpt2' model"):
        model_config(str(tmp_path), family="llama")
    assert model_config(str(tmp_path), family="gpt2").model_type == "gpt2"
