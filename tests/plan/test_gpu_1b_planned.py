"""The `1b` preset planned for one 80 GB GPU (ds_configs/gpu_1b_planned_80gb.json, docs/plan.md), solved
here with the device-free parts: a made-up CUDA profile of the preset (its tensors and saved bytes from
the analytic costs, speeds of an H100-class GPU behind PCIe), the problem a planned run builds from it,
the MILP, the simulator and the DeepSpeed config the plan implies. Nothing is measured; no GPU is needed."""

import json
from pathlib import Path

import pytest

from lazyzero.config import PlanConfig, check_config_file, validate_ds_config
from lazyzero.models.presets import PRESETS
from lazyzero.plan import check_within_budgets, deepspeed_default_plan, greedy_plan, solve
from lazyzero.plan.deepspeed.costs import (
    EMBED_AND_HEAD,
    decoder_layer_costs,
    decoder_layer_name,
    decoder_layer_tensors,
    embed_and_head_costs,
    embed_and_head_tensors,
)
from lazyzero.plan.deepspeed.engine_setup import _base_config
from lazyzero.plan.deepspeed.implied import eight_bit_share, implied_setup
from lazyzero.plan.deepspeed.problem_from_profile import problem_for_config
from lazyzero.plan.profile.data import (
    Bandwidth,
    Fingerprint,
    LayerProfile,
    MachineProfile,
    MemorySnapshot,
    ModelProfile,
    OptimizerSpeed,
    TensorInfo,
)

CONFIG = Path(__file__).parents[2] / "ds_configs" / "gpu_1b_planned_80gb.json"
GB = 10**9
# An H100-class GPU: bf16 matrix work sustained at 400 TFLOP/s, PCIe 5 copies at 25 GB/s each way.
GPU_TFLOPS, PCIE_BYTES_PER_S = 400, 25 * GB
# Optimizer steps in seconds per fp32 parameter: torch's fused AdamW and the 8-bit step on the device
# (bound by HBM), DeepSpeed's CPU Adam on 16 cores, the 8-bit step on the host.
OPTIMIZER_S_PER_PARAM = {"torch_adamw": ("cuda", 2e-11), "lazyzero_adamw8bit_cuda": ("cuda", 1e-11),
                         "deepspeed_cpu_adam": ("cpu", 1e-9), "lazyzero_adamw8bit": ("cpu", 8e-10)}
MIXED_PRECISION_ADAM_BYTES = 16


def made_up_layer(costs, tensors: dict[str, int], kind: str) -> LayerProfile:
    """A profile row carrying the analytic costs: packing adds 5% (8 bits) and 10% (4 bits) to the
    layer's times, and 8 bits stays within plan.max_grad_error (4 bits does not)."""
    decoder = kind == "decoder"
    return LayerProfile(
        name=costs.name, kind=kind, measured_as=costs.name, fwd_s=costs.fwd_s, bwd_s=costs.bwd_s,
        recompute_s=costs.fwd_s if decoder else None, checkpointed_fwd_s=None, checkpointed_bwd_s=None,
        packed_fwd_s={16: costs.fwd_s, 8: 1.05 * costs.fwd_s, 4: 1.1 * costs.fwd_s},
        packed_bwd_s={16: costs.bwd_s, 8: 1.05 * costs.bwd_s, 4: 1.1 * costs.bwd_s},
        act_bytes=dict(costs.act_bytes), input_bytes=costs.input_bytes, output_bytes=costs.input_bytes,
        transient_fwd_bytes=2 * costs.input_bytes, transient_bwd_bytes=4 * costs.input_bytes,
        tensors={name: TensorInfo(numel, "bfloat16") for name, numel in tensors.items()},
        grad_error={16: 0.0, 8: 0.004, 4: 0.05} if decoder else {16: 0.0, 8: 0.0, 4: 0.0})


def made_up_gpu_profile(preset: str, seq: int) -> ModelProfile:
    """One rank's profile of `preset` on a CUDA device, micro-batch 1 of `seq` tokens, bf16."""
    dims = PRESETS[preset]
    shape = dict(seq=seq, micro_batch=1, gpu_tflops=GPU_TFLOPS)
    rows = []
    for index in range(dims.layers):
        tensors = {f"{decoder_layer_name(index)}.{name}": n for name, n in decoder_layer_tensors(dims).items()}
        rows.append(made_up_layer(decoder_layer_costs(dims, index, **shape), tensors, "decoder"))
    rows.append(made_up_layer(embed_and_head_costs(dims, **shape), embed_and_head_tensors(dims), "embed_and_head"))
    optimizers = {name: OptimizerSpeed(device, 10**6, 10**6 * s, s, 8.0, s / 8, "native")
                  for name, (device, s) in OPTIMIZER_S_PER_PARAM.items()}
    machine = MachineProfile(
        "cuda", "made-up H100", 16, 128 * 2**30,
        {"host_copy": Bandwidth(10 * GB, 1, 0.1), "h2d": Bandwidth(PCIE_BYTES_PER_S, 1, 0.04),
         "d2h": Bandwidth(PCIE_BYTES_PER_S, 1, 0.04)},
        None, optimizers, {}, {"nvme": "no nvme_path"})
    fingerprint = Fingerprint("sha", 1, seq, "bfloat16", 16, 1, "t", "d", "l", "made-up H100", None, "s")
    # On CUDA the snapshot is the device's memory: the CUDA context is outside the allocator's count.
    memory = MemorySnapshot(rss_bytes=0, param_bytes=0, buffer_bytes=0)
    shared = {bits: 2 * seq * dims.hidden * 2 for bits in (16, 8, 4)}  # rotary cos and sin
    return ModelProfile(fingerprint, tuple(rows), shared, machine, memory, {}, 1.0)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads(CONFIG.read_text())


@pytest.fixture(scope="module")
def planned(config):
    """(problem, sizes, MILP plan) a one-GPU planned run of the config solves."""
    settings = PlanConfig(**config["lazyzero"]["plan"])
    profile = made_up_gpu_profile("1b", settings.seq_len)
    problem, sizes = problem_for_config(profile, config, settings, world_size=1, local_ranks=1)
    plan = solve(problem, time_limit_s=20, max_gap=0.01, warm_start=greedy_plan(problem))
    return problem, sizes, plan


def test_the_config_passes_validation_for_one_gpu(config):
    check_config_file(CONFIG, world_size=1)
    plan = config["lazyzero"]["plan"]
    assert plan["enabled"] and plan.get("nvme_path") is None  # no aio op needed on the GPU machine


def test_its_gpu_budget_is_well_below_the_training_state(config, planned):
    problem, _, _ = planned
    settings = PlanConfig(**config["lazyzero"]["plan"])
    parameters = sum(sum(decoder_layer_tensors(PRESETS["1b"]).values()) for _ in range(PRESETS["1b"].layers)) + \
        sum(embed_and_head_tensors(PRESETS["1b"]).values())
    assert settings.gpu_mem * 1.5 < parameters * MIXED_PRECISION_ADAM_BYTES < 80 * GB
    gpu, cpu = problem.machine.tiers["gpu"], problem.machine.tiers["cpu"]
    assert gpu.capacity_bytes == round(settings.gpu_mem * (1 - settings.memory_reserve))
    assert cpu.capacity_bytes == settings.cpu_mem and problem.machine.has_host
    assert set(problem.machine.paths) == {"h2d", "d2h"}


def test_the_plan_fits_every_budget_in_the_simulator(planned):
    problem, _, plan = planned
    assert plan.status in ("optimal", "feasible") and plan.gap <= 0.01
    simulation = check_within_budgets(problem, plan)
    assert simulation.peak_bytes["gpu"] <= problem.machine.tiers["gpu"].capacity_bytes
    assert simulation.step_s == pytest.approx(plan.predicted_step_s, rel=1e-6)
    # Something had to leave the device: the state alone is over the budget.
    assert any(lp.param_tier != "gpu" or lp.state_tier != "gpu" or lp.act_mode == "recompute" or lp.offloaded
               for lp in plan.layers)


def test_the_implied_deepspeed_config_is_the_plan(config, planned):
    problem, sizes, plan = planned
    setup = implied_setup(problem, plan, base=_base_config(config), sizes=sizes)
    validate_ds_config(setup.ds_config, world_size=1)
    zero = setup.ds_config["zero_optimization"]
    assert zero["stage"] == 3 and not setup.param_nvme_layers and not setup.optimizer_nvme_layers
    for section, tiers in (("offload_param", {lp.param_tier for lp in plan.layers}),
                           ("offload_optimizer", {lp.state_tier for lp in plan.layers})):
        assert len(tiers) == 1  # DeepSpeed offloads all of a kind or none
        assert zero[section]["device"] == {"gpu": "none", "cpu": "cpu"}[tiers.pop()]
    section = setup.ds_config["lazyzero"]
    if any(lp.state_8bit for lp in plan.layers):
        assert section["optimizer"]["fraction_8bit"] == eight_bit_share(problem, plan)
    recomputed = [i for i, (c, lp) in enumerate(zip(problem.layers, plan.layers))
                  if lp.act_mode == "recompute" and c.name != EMBED_AND_HEAD]
    assert section.get("activations", {}).get("recompute_layers", []) == recomputed
    assert "plan" not in section


def test_zero_infinitys_offload_under_the_same_budget_is_what_the_benchmark_compares(config, planned):
    """DeepSpeed's default of the same problem (benchmarks/bench_planner.py --gpu): parameters and fp32
    states in host memory, no recompute; a plain DeepSpeed config, slower than the plan by the model."""
    problem, sizes, plan = planned
    baseline = deepspeed_default_plan(problem)
    setup = implied_setup(problem, baseline, base=_base_config(config), sizes=sizes)
    zero = setup.ds_config["zero_optimization"]
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["device"] == "cpu"
    assert "optimizer" not in setup.ds_config["lazyzero"]
    assert baseline.predicted_step_s >= plan.predicted_step_s
