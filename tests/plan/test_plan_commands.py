"""`lazyzero plan` (docs/plan.md): analytic costs of the presets, the CLI end to end, the implied DeepSpeed
config (validated like a user's) and the per-layer widths it gives the activation policy."""

import json

import pytest

from lazyzero.activations.policy import ActivationPolicy
from lazyzero.cli import main
from lazyzero.config import ActivationsConfig, check_config_file
from lazyzero.models.presets import PRESETS
from lazyzero.plan import LayerPlan, Plan, check_within_budgets, deepspeed_default_plan
from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD, problem_from_preset
from lazyzero.plan.deepspeed.implied import eight_bit_share, implied_ds_config
from lazyzero.plan.solver.simulate import evaluate_layers

GB = 10**9
SPEEDS = dict(gpu_tflops=400, h2d_gbps=25, d2h_gbps=25, nvme_read_gbps=3, nvme_write_gbps=2)


def tiny_problem(**budgets):
    return problem_from_preset("tiny", **{"gpu_mem": GB, "cpu_mem": GB, "nvme_path": None, **budgets},
                               seq=256, micro_batch=2, **SPEEDS)


def test_tiny_layer_costs_match_a_hand_computation():
    """tiny: hidden 64, 4 heads, 2 kv heads (k, v 32 wide), intermediate 176; 2 * 256 = 512 tokens."""
    layer = tiny_problem().layers[0]
    # 16 bits, per token: norms 2 * (4 + 2) * 64 = 768; attention 2 * (64 + 64 + 32 + 32 + 64) = 512;
    # MLP 2 * 64 + 4 * 2 * 176 = 1536. Total 2816.
    assert layer.act_bytes[16] == 512 * 2816
    # 8 bits: norms 2 * 64 * (1 + 4/64) = 136; attention without its input (rebuilt from the norm's):
    # q and k 2 * (64 + 32) = 192, v and the output at 8 bits (32 + 64) * (1 + 4/64) = 102;
    # MLP gate and up 2 * 176 * (1 + 4/64) = 374.
    assert layer.act_bytes[8] == 512 * (136 + 192 + 102 + 374)
    # 4 bits: norms, v and the output still at 8 bits; MLP 2 * 176 * (0.5 + 4/64) = 198.
    assert layer.act_bytes[4] == 512 * (136 + 192 + 102 + 198)
    assert layer.input_bytes == 512 * 2 * 64
    # Parameters: q, o 4096 each; k, v 2048 each; MLP 3 * 64 * 176 = 33792; norms 128. Total 46208.
    assert layer.param_bytes == layer.grad_bytes == 2 * 46208
    assert layer.optim_state_bytes_fp32 == 12 * 46208
    # 8-bit: q, o and the MLP (41984 elements) at 2 + 8/256 + 4 = 6.03125 B; k and v (under
    # min_8bit_size 4096) and the norms (fp32_patterns) stay at 12 B: 253216 + 12 * 4224.
    assert layer.optim_state_bytes_8bit == 253216 + 12 * 4224
    # 2 * tokens * params + causal attention 4 * b * s^2 * h / 2, at 400 TFLOP/s.
    assert layer.fwd_s == pytest.approx((2 * 512 * 46208 + 2 * 2 * 256**2 * 64) / 400e12, rel=1e-12)
    assert layer.bwd_s == 2 * layer.fwd_s


def test_embeddings_and_head_are_one_extra_layer_without_activations():
    problem = tiny_problem()
    head = problem.layers[-1]
    assert [c.name for c in problem.layers] == ["model.layers.0", "model.layers.1", EMBED_AND_HEAD]
    assert set(head.act_bytes.values()) == {0} and head.input_bytes == 0
    # Untied embedding and lm_head (vocab x 64 each) plus the final norm; embedding and norm stay fp32.
    vocab = PRESETS["tiny"].vocab_size
    assert head.param_bytes == 2 * (2 * vocab * 64 + 64)
    assert head.optim_state_bytes_8bit == round(vocab * 64 * 6.03125) + 12 * (vocab * 64 + 64)


def run_plan(tmp_path, capsys, *args):
    out = tmp_path / "out"
    status = main(["plan", *args, "--time-limit", "5", "--out", str(out)])
    return status, out, capsys.readouterr()


def check_outputs(out, problem):
    assert sorted(p.name for p in out.iterdir()) == ["ds_config.json", "memory.png", "plan.json"]
    plan = Plan.from_json((out / "plan.json").read_text())
    check_within_budgets(problem, plan)
    check_config_file(out / "ds_config.json")
    assert (out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return plan


@pytest.mark.parametrize("gpu_gb, cpu_gb", [(24, 64), (80, 120)])
def test_plan_7b_on_one_gpu_with_a_host(tmp_path, capsys, gpu_gb, cpu_gb):
    status, out, printed = run_plan(tmp_path, capsys, "--model", "7b", "--gpu-mem", f"{gpu_gb}GB",
                                    "--cpu-mem", f"{cpu_gb}GB")
    assert status == 0, printed.err
    problem = problem_from_preset("7b", gpu_mem=gpu_gb * GB, cpu_mem=cpu_gb * GB, nvme_path=None, seq=4096,
                                  micro_batch=1, **SPEEDS)
    plan = check_outputs(out, problem)
    assert f"predicted step time {plan.predicted_step_s:.3f} s" in printed.out
    for baseline in ("greedy:", "fixed rule (k=4):", "DeepSpeed default:"):
        assert baseline in printed.out
    assert "model.layers.31" in printed.out and "gpu" in printed.out


def test_plan_27b_on_80gb_with_400gb_host_and_nvme(tmp_path, capsys):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    status, out, printed = run_plan(tmp_path, capsys, "--model", "27b", "--gpu-mem", "80GB", "--cpu-mem", "400GB",
                                    "--nvme", str(nvme))
    assert status == 0, printed.err
    problem = problem_from_preset("27b", gpu_mem=80 * GB, cpu_mem=400 * GB, nvme_path=str(nvme), seq=4096,
                                  micro_batch=1, **SPEEDS)
    check_outputs(out, problem)
    assert "nvme" in printed.out


def test_infeasible_budgets_exit_2_naming_the_tier(tmp_path, capsys):
    status, out, printed = run_plan(tmp_path, capsys, "--model", "7b", "--gpu-mem", "1GB", "--cpu-mem", "2GB")
    assert status == 2
    assert "infeasible budget for tier(s) gpu" in printed.err and "capacity 1.00 GB: short by 2.05 GB" in printed.err
    assert not out.exists()


def test_implied_config_offloads_to_nvme_where_most_bytes_live(tmp_path):
    # 10 GB of host memory cannot hold 7b's states: DeepSpeed's default sends everything to NVMe.
    problem = problem_from_preset("7b", gpu_mem=80 * GB, cpu_mem=10 * GB, nvme_path=str(tmp_path), seq=4096,
                                  micro_batch=1, **SPEEDS)
    config = implied_ds_config(problem, deepspeed_default_plan(problem), nvme_path=str(tmp_path))
    for section in ("offload_param", "offload_optimizer"):
        assert config["zero_optimization"][section]["device"] == "nvme"
        assert config["zero_optimization"][section]["nvme_path"] == str(tmp_path)
    assert "optimizer" not in config["lazyzero"] and "activations" not in config["lazyzero"]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    check_config_file(path)


def test_implied_widths_reach_the_activation_policy_as_planned():
    """Quantized layers quantize their MLP only (attention 16, norms at least 8), 16-bit layers
    nothing, recomputed layers are listed; the 8-bit share counts the layers with 8-bit state."""
    problem = problem_from_preset("demo", gpu_mem=GB, cpu_mem=GB, nvme_path=None, seq=256, micro_batch=2, **SPEEDS)
    keep16 = LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)
    layers = [LayerPlan("keep", 4, "gpu", "gpu", "gpu", True), keep16,
              LayerPlan("recompute", 16, "gpu", "gpu", "gpu", False),
              keep16, keep16, LayerPlan("keep", 8, "gpu", "gpu", "gpu", True), keep16]
    plan = evaluate_layers(problem, layers, "greedy")
    section = implied_ds_config(problem, plan)["lazyzero"]
    assert section["activations"]["recompute_layers"] == [2]
    policy = ActivationPolicy(ActivationsConfig(**section["activations"]))

    def widths(layer):
        return [policy.bits_for(f"model.layers.{layer}.{name}", kind, layer) for name, kind in
                (("self_attn", "attention"), ("mlp", "mlp"), ("input_layernorm", "norm"),
                 ("post_attention_layernorm", "norm"))]

    assert widths(0) == [16, 4, 8, 8] and widths(5) == [16, 8, 8, 8]
    assert widths(1) == widths(2) == widths(4) == [16] * 4
    savings = [c.optim_state_bytes_fp32 - c.optim_state_bytes_8bit for c in problem.layers]
    share = round((savings[0] + savings[5]) / sum(savings), 4)
    assert section["optimizer"] == {"enabled": True, "type": "adamw8bit", "fraction_8bit": share}
    assert eight_bit_share(problem, plan) == share


def test_a_replans_config_drops_what_the_running_plan_set_for_its_layers(tmp_path):
    """A re-plan's base is the running plan's config: its offloaded layers may be the new plan's
    recomputed ones (a SmolLM2 run under the Trainer stopped on exactly that), and a new plan that
    keeps everything at 16 bits leaves the section off. The user's own settings stay."""
    problem = problem_from_preset("demo", gpu_mem=GB, cpu_mem=GB, nvme_path=str(tmp_path), seq=256, micro_batch=2,
                                  **SPEEDS)
    keep16 = LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)
    offloaded = [LayerPlan("keep", 8, "nvme", "gpu", "gpu", False)] * 6 + [keep16]
    recomputed = [LayerPlan("recompute", 16, "gpu", "gpu", "gpu", False)] * 6 + [keep16]
    running = implied_ds_config(problem, evaluate_layers(problem, offloaded, "greedy"), nvme_path=str(tmp_path))
    running["lazyzero"]["activations"]["block_size"] = 128  # the user's
    section = implied_ds_config(problem, evaluate_layers(problem, recomputed, "greedy"), base=running,
                                nvme_path=str(tmp_path))["lazyzero"]["activations"]
    assert section["recompute_layers"] == list(range(6)) and "offload_layers" not in section
    assert section["block_size"] == 128
    ActivationsConfig(**section)  # valid as a whole
    unchanged = implied_ds_config(problem, evaluate_layers(problem, [keep16] * 7, "greedy"), base=running)
    assert unchanged["lazyzero"]["activations"] == {"block_size": 128}
