"""A measured profile becomes one ZeRO-3 rank's planning problem (docs/plan.md): partitions, collectives
added to the layers' times, measured optimizer speeds, per-rank budgets and the workspace, checked
against hand computations on a made-up profile (nothing is measured here)."""

import math
from dataclasses import replace

import pytest

from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD
from lazyzero.plan.deepspeed.problem_from_profile import (
    Budgets,
    RankShape,
    problem_for_config,
    problem_from_profile,
    uses_torch_adam,
)
from lazyzero.plan.deepspeed.swap_buffers import aligned
from lazyzero.plan.profile.data import (
    Bandwidth,
    CollectiveSpeed,
    Fingerprint,
    LayerProfile,
    MachineProfile,
    MemorySnapshot,
    ModelProfile,
    OptimizerSpeed,
    TensorInfo,
)

MB = 10**6
LAYER_TENSORS = {"self_attn.q_proj.weight": 64 * 64, "self_attn.k_proj.weight": 64 * 32, "mlp.up_proj.weight": 64 * 177,
                 "input_layernorm.weight": 64}
HEAD_TENSORS = {"model.embed_tokens.weight": 300 * 64, "model.norm.weight": 64, "lm_head.weight": 300 * 64}


# Measured gradient errors per width (grad_error.py): layer 1 suffers at 4 bits, as a layer whose
# stored activations carry massive channels does.
GRAD_ERRORS = {"model.layers.0": {16: 0.0, 8: 0.004, 4: 0.03}, "model.layers.1": {16: 0.0, 8: 0.006, 4: 0.09},
               EMBED_AND_HEAD: {16: 0.0, 8: 0.0, 4: 0.0}}


def layer(name, tensors, kind="decoder", act=None):
    return LayerProfile(
        name=name, kind=kind, measured_as=name, fwd_s=0.1, bwd_s=0.2, recompute_s=0.09 if kind == "decoder" else None,
        checkpointed_fwd_s=None, checkpointed_bwd_s=None, packed_fwd_s={16: 0.1, 8: 0.11, 4: 0.12},
        packed_bwd_s={16: 0.2, 8: 0.23, 4: 0.25}, act_bytes=act or {16: 30 * MB, 8: 12 * MB, 4: 10 * MB},
        input_bytes=2 * MB, output_bytes=2 * MB, transient_fwd_bytes=3 * MB, transient_bwd_bytes=5 * MB,
        tensors={key: TensorInfo(numel, "bfloat16") for key, numel in tensors.items()}, grad_error=GRAD_ERRORS[name])


def speed(s_per_param):
    return OptimizerSpeed("cpu", 1000, 1000 * s_per_param, s_per_param, 8.0, 0.0, "native")


def made_up_profile(world_size=2):
    layers = [layer(f"model.layers.{i}", {f"model.layers.{i}.{k}": n for k, n in LAYER_TENSORS.items()})
              for i in range(2)]
    layers.append(layer(EMBED_AND_HEAD, HEAD_TENSORS, kind="embed_and_head", act={16: 4 * MB, 8: 2 * MB, 4: 2 * MB}))
    machine = MachineProfile(
        "cpu", "test cpu", 1, 64 * 10**9,
        {"host_copy": Bandwidth(3e9, 1, 1.0), "nvme_write": Bandwidth(1e9, 1, 1.0),
         "nvme_read": Bandwidth(2e9, 1, 1.0)},
        None, {"torch_adamw": speed(12e-9), "deepspeed_cpu_adam": speed(2.4e-9), "lazyzero_adamw8bit": speed(3e-9)},
        {"all_gather": CollectiveSpeed(world_size, "bfloat16", 1, 1.0, 1e-9),
         "reduce_scatter": CollectiveSpeed(world_size, "bfloat16", 1, 1.0, 2e-9)}, {})
    fingerprint = Fingerprint("sha", 2, 32, "bfloat16", 1, world_size, "t", "d", "l", "test cpu", None, "s")
    return ModelProfile(fingerprint, tuple(layers), {16: MB, 8: MB, 4: MB}, machine,
                        MemorySnapshot(rss_bytes=500 * MB, param_bytes=100 * MB, buffer_bytes=0), {}, 1.0)


@pytest.fixture
def problem(tmp_path):
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=str(tmp_path), local_ranks=2)
    return problem_from_profile(made_up_profile(), budgets, RankShape(2, "bfloat16", True, True))


def test_decoder_layer_is_the_ranks_partition_with_collectives_in_its_times(problem):
    problem, _ = problem
    costs = problem.layers[0]
    numel = sum(LAYER_TENSORS.values())
    partition = sum(math.ceil(n / 2) for n in LAYER_TENSORS.values())
    # bf16 parameters; with an NVMe tier and no GPU the optimizer is offloaded, so DeepSpeed keeps
    # fp32 gradient partitions; its NVMe swapper's buffers are held all along (in the workspace), so
    # stepping a layer stages nothing more.
    assert costs.param_bytes == 2 * partition and costs.grad_bytes == 4 * partition
    assert costs.stage_bytes_fp32 == costs.stage_bytes_8bit == 0
    gather, scatter = 1e-9 * 2 * numel, 2e-9 * 2 * numel  # full layer in bf16, per byte
    assert costs.fwd_s == pytest.approx(0.1 + gather) and costs.bwd_s == pytest.approx(0.2 + gather + scatter)
    assert costs.recompute_s == 0.09
    assert costs.pack_fwd_s == pytest.approx({16: 0.0, 8: 0.01, 4: 0.02})
    assert costs.pack_bwd_s == pytest.approx({16: 0.0, 8: 0.03, 4: 0.05})
    # fp32: moments 8 B + master 4 B; 8-bit: q and up (>= 4096 elements, not a norm) at 2 + 8/256 + 4.
    assert costs.optim_state_bytes_fp32 == 12 * partition
    eight_bit = (2 + 8 / 256 + 4) * (64 * 64 / 2 + 64 * 177 / 2) + 12 * (64 * 32 / 2 + 64 / 2)
    assert costs.optim_state_bytes_8bit == round(eight_bit)
    assert costs.act_bytes == {16: 30 * MB, 8: 12 * MB, 4: 10 * MB} and costs.input_bytes == 2 * MB


def test_the_head_keeps_what_it_saves_at_every_width_and_never_gains_from_recompute(problem):
    problem, _ = problem
    head = problem.layers[-1]
    assert head.name == EMBED_AND_HEAD
    assert head.act_bytes == {16: 4 * MB, 8: 4 * MB, 4: 4 * MB} and head.input_bytes == 4 * MB
    assert head.pack_fwd_s == head.pack_bwd_s == {16: 0.0, 8: 0.0, 4: 0.0}


def test_budgets_are_split_among_the_ranks_of_the_host(problem, tmp_path):
    import shutil

    problem, _ = problem
    tiers = problem.machine.tiers
    assert sorted(tiers) == ["gpu", "nvme"] and tiers["gpu"].capacity_bytes == 2 * 10**9
    free = shutil.disk_usage(tmp_path).free // 2
    assert abs(tiers["nvme"].capacity_bytes - free) < 100 * MB
    assert problem.machine.paths["nvme_read"].bytes_per_s == 2e9 and "d2h" not in problem.machine.paths


def test_optimizer_speeds_per_state_byte_are_the_measured_steps(problem):
    problem, _ = problem
    machine = problem.machine
    # Without a GPU, with NVMe: DeepSpeed's CPU Adam steps every fp32 state (the optimizer is offloaded).
    assert machine.gpu_adam_s_per_byte == machine.cpu_adam_s_per_byte == pytest.approx(2.4e-9 / 12)
    assert machine.nvme_swaps_block and machine.nvme_state_takes_grads and machine.nvme_grads_resident
    assert machine.gpu_adam8_s_per_byte == pytest.approx(3e-9 / (2 + 8 / 256 + 4))


def test_offloaded_fp32_states_step_with_torchs_adamw_where_the_config_asks_for_it(tmp_path):
    # DeepSpeed builds torch.optim.AdamW from "torch_adam": true even with the optimizer offloaded.
    config = {"bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3}}
    assert uses_torch_adam(config)
    assert not uses_torch_adam({**config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    assert not uses_torch_adam({**config, "optimizer": {"type": "Lamb", "params": {"torch_adam": True}}})
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=str(tmp_path), local_ranks=2)
    machine = problem_from_profile(made_up_profile(), budgets, RankShape(2, "bfloat16", True, True, True))[0].machine
    assert machine.gpu_adam_s_per_byte == machine.cpu_adam_s_per_byte == pytest.approx(12e-9 / 12)
    assert machine.gpu_adam8_s_per_byte == pytest.approx(3e-9 / (2 + 8 / 256 + 4))


def test_the_engines_own_optimizer_is_no_part_of_deepspeeds_cost_per_layer(tmp_path):
    """Calibration engines that took exactly what the problem predicts with the optimizer they ran
    (torch's AdamW, from the run's config) add no cost to any layer, so a plan stepping 8-bit states
    is predicted without torch's step; priced as DeepSpeed's CPU Adam instead, torch's extra time
    would be taken for DeepSpeed's own and stay in every layer's backward."""
    from lazyzero.plan.deepspeed.calibrate import _cut, _in_memory_prediction
    from lazyzero.plan.profile.data import EngineCalibration, EngineRun
    from lazyzero.plan.solver.problem import LayerPlan
    from lazyzero.plan.solver.simulate import evaluate_layers

    profile = _five_layer_profile()
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=None, local_ranks=2)
    shape = RankShape(2, "bfloat16", True, True, torch_adam=True)
    plain, _ = problem_from_profile(profile, budgets, shape, process_bytes=0)
    runs = tuple(EngineRun(n, _in_memory_prediction(_cut(plain, n))[0], 0, 0, 0) for n in (1, 3))
    eight_bit = [LayerPlan("keep", 16, "gpu", "gpu", "gpu", True)] * plain.num_layers
    calibrated = replace(profile, engine=EngineCalibration(runs, {}))
    problem, _ = problem_from_profile(calibrated, budgets, shape, process_bytes=0)
    assert [c.bwd_s for c in problem.layers] == pytest.approx([c.bwd_s for c in plain.layers])
    assert (evaluate_layers(problem, eight_bit, "greedy").predicted_step_s
            == pytest.approx(evaluate_layers(plain, eight_bit, "greedy").predicted_step_s))
    # The same engines under the optimizer it did not run: its step time lands in the layers.
    budgets_nvme = replace(budgets, nvme_path=str(tmp_path))
    shape_ds = replace(shape, torch_adam=False)
    wrong, _ = problem_from_profile(calibrated, budgets_nvme, shape_ds, process_bytes=0)
    right, _ = problem_from_profile(calibrated, budgets_nvme, shape, process_bytes=0)
    assert sum(c.bwd_s for c in wrong.layers) > sum(c.bwd_s for c in right.layers) + 1e-6


def test_without_nvme_the_optimizer_stays_in_memory():
    problem, _ = problem_from_profile(made_up_profile(), Budgets(4 * 10**9, None, None, 2),
                                      RankShape(2, "bfloat16", True, True))
    assert problem.machine.gpu_adam_s_per_byte == pytest.approx(12e-9 / 12)
    assert problem.layers[0].grad_bytes == problem.layers[0].param_bytes
    assert not problem.machine.nvme_state_takes_grads


def test_an_fp32_model_without_a_gpu_keeps_its_parameters_off_nvme(tmp_path):
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=str(tmp_path), local_ranks=2)
    fp32, _ = problem_from_profile(made_up_profile(), budgets, RankShape(2, "float32", False, True))
    bf16, _ = problem_from_profile(made_up_profile(), budgets, RankShape(2, "bfloat16", True, True))
    assert fp32.param_tiers == ("gpu",) and bf16.param_tiers is None


def test_workspace_is_the_process_plus_what_every_plan_holds(problem, tmp_path):
    problem, sizes = problem
    numel = sum(LAYER_TENSORS.values())
    head = sum(HEAD_TENSORS.values())
    partitions = sum(math.ceil(n / 2) for n in list(LAYER_TENSORS.values()) * 2 + list(HEAD_TENSORS.values()))
    largest_tensor = math.ceil(max(HEAD_TENSORS.values()) / 2)
    # A sub-group closes once it reaches one layer's partition: at most that - 1 plus one tensor.
    group = math.ceil(numel / 2) - 1 + largest_tensor
    optimizer_swap = 4 * aligned(group, 4) * 4
    expected = (400 * MB                      # the process without the model it held when profiled
                + (2 * numel + head) * 2       # two gathered layers and the head, bf16
                + 5 * MB                       # the larger temporaries of a layer
                + numel * 2                    # one reduce bucket
                + math.ceil(numel / 2) * 4     # the optimizer's fp32 gradient copy of one sub-group
                + MB                           # rotary tables and mask, saved once per forward
                + 2 * partitions               # the optimizer is offloaded: DeepSpeed's flat bf16 gradients
                + optimizer_swap)              # and its NVMe swapper's 4 fp32 buffers
    assert problem.workspace_bytes == expected
    # Held when any layer's parameters are on NVMe: the swapper's pool (2 per tensor of a layer, each
    # of the largest tensor's partition) and a buffer of the largest sub-group's whole tensors.
    assert problem.param_swap_bytes == 2 * 4 * aligned(largest_tensor, 2) * 2 + aligned(2 * group, 2) * 2
    measured, _ = problem_from_profile(made_up_profile(), Budgets(4 * 10**9, None, str(tmp_path), 2),
                                       RankShape(2, "bfloat16", True, True), process_bytes=123 * MB)
    assert measured.workspace_bytes == expected - 400 * MB + 123 * MB
    assert sizes.largest_layer_numel == numel and sizes.world_size == 2 and sizes.tensors_per_layer == 4


def test_a_cuda_profile_needs_a_gpu_budget(tmp_path):
    import dataclasses

    profile = made_up_profile()
    profile = dataclasses.replace(profile, machine=dataclasses.replace(profile.machine, device_type="cuda"))
    with pytest.raises(ValueError, match="lazyzero.plan.gpu_mem"):
        problem_from_profile(profile, Budgets(None, None, None, 1), RankShape(2, "bfloat16", True, True))


def test_other_features_add_what_they_hold_whatever_the_plan():
    from lazyzero.plan.deepspeed.problem_from_profile import feature_workspace_bytes

    profile, shape = made_up_profile(), RankShape(2, "bfloat16", True, True)
    layer_numel = sum(LAYER_TENSORS.values())
    total = 2 * layer_numel + sum(HEAD_TENSORS.values())
    assert feature_workspace_bytes(profile, {"lazyzero": {}}, shape) == 0
    int8 = {"lazyzero": {"gradients": {"enabled": True}}}
    # One bucket (a layer) of scratch: three fp32 rows and two int8 code buffers per element.
    assert feature_workspace_bytes(profile, int8, shape) == 14 * layer_numel
    int8["lazyzero"]["gradients"]["error_feedback"] = True
    # Error feedback keeps an fp32 residual of every gradient element the rank sends.
    assert feature_workspace_bytes(profile, int8, shape) == 14 * layer_numel + 4 * total
    # Lazy checkpoints' snapshot depends on the plan's state formats: PlanProblem.snapshot, not here.
    assert feature_workspace_bytes(profile, {"lazyzero": {"checkpoint": {"enabled": True}}}, shape) == 0


def _rank_files(profile, world_size: int, eight_bit: bool) -> dict:
    """One ZeRO-3 rank's checkpoint files for `profile`'s model, as DeepSpeed and lazyzero save them
    (host tensors, each its own storage): per tensor the fp32 partition and Adam's moments, fp32 or
    8-bit (codes and one fp32 scale per 256-element block, as AdamW8bit keeps them), and lazyzero's
    rank state with an fp32 error-feedback residual of every parameter."""
    import torch

    from lazyzero.plan.deepspeed.costs import optimizer_state_bytes

    optim, residual = {}, 0
    for row in profile.layers:
        for name, tensor in row.tensors.items():
            part = math.ceil(tensor.numel / world_size)
            state = optimizer_state_bytes({name: tensor.numel}, eight_bit, master_bytes=0, world_size=world_size)
            optim[name] = {"fp32": torch.zeros(part), "moments": torch.zeros(state, dtype=torch.uint8)}
            residual += tensor.numel
    return {"optim_states.pt": {"state": optim}, "model_states.pt": {"module": {}},
            "lazyzero_rank0.pt": {"residual": torch.zeros(residual)}}


def _save_files(engine, save_dir, files: dict) -> None:
    """What DeepSpeed's save_checkpoint does with a checkpoint engine, for these files."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    engine.prepare(str(save_dir), save_latest=True, global_steps=1, barrier=lambda: None)
    info = CheckpointCommitInfo(tag="step1", save_dir=str(save_dir), save_latest=False)
    engine.create(info)
    for name, state in files.items():
        engine.save(state, str(save_dir / "step1" / name))
    engine.commit(info)
    engine.wait()


@pytest.mark.parametrize("eight_bit", [False, True])
def test_the_predicted_peak_holds_the_snapshot_the_checkpoint_code_allocates(tmp_path, eight_bit):
    from lazyzero.checkpoint.config import CheckpointConfig
    from lazyzero.checkpoint.lazy_engine import LazyCheckpointEngine
    from lazyzero.config import PlanConfig
    from lazyzero.plan.solver.problem import LayerPlan
    from lazyzero.plan.solver.simulate import evaluate_layers

    ds_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                 "lazyzero": {"checkpoint": {"enabled": True}, "gradients": {"enabled": True, "error_feedback": True}}}
    settings = PlanConfig(enabled=True, seq_len=8, cpu_mem=4 * 10**9)
    problem, _ = problem_for_config(made_up_profile(), ds_config, settings, 2, 2, process_bytes=0)
    layers = [LayerPlan("keep", 16, "gpu", "gpu", "gpu", eight_bit)] * problem.num_layers
    # The checkpoint code's own figure for the files this rank writes, and what it then holds.
    engine = LazyCheckpointEngine(CheckpointConfig(enabled=True), rank=0, world_size=1, on_cuda=False)
    _save_files(engine, tmp_path, _rank_files(made_up_profile(), 2, eight_bit))
    commit = engine.last_commit
    engine.close()
    assert problem.snapshot_held(layers) == commit["host_bytes_bound"] >= commit["host_bytes"] > 0
    # ... in the predicted peak of the compute memory (no GPU: host memory), in every window.
    without = replace(problem, snapshot=None)
    peaks = [evaluate_layers(p, layers, "greedy").predicted_peak_bytes["gpu"] for p in (problem, without)]
    assert peaks[0] - peaks[1] == pytest.approx(commit["host_bytes_bound"])


def test_the_milp_and_the_simulator_agree_on_the_snapshot_and_a_limit_caps_it(tmp_path):
    from lazyzero.config import PlanConfig
    from lazyzero.plan import solve
    from lazyzero.plan.solver.simulate import evaluate_layers

    ds_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                 "lazyzero": {"checkpoint": {"enabled": True}}}
    settings = PlanConfig(enabled=True, seq_len=8, cpu_mem=4 * 10**9)
    problem, _ = problem_for_config(made_up_profile(), ds_config, settings, 2, 2, process_bytes=0)
    plan = solve(problem, max_gap=0.0)
    simulated = evaluate_layers(problem, plan.layers, "greedy").predicted_peak_bytes["gpu"]
    assert plan.predicted_peak_bytes["gpu"] == pytest.approx(simulated, rel=1e-6)
    ds_config["lazyzero"]["checkpoint"]["host_buffer_limit"] = "9MB"
    limited, _ = problem_for_config(made_up_profile(), ds_config, settings, 2, 2, process_bytes=0)
    assert limited.snapshot_held(plan.layers) == 9 * MB < problem.snapshot_held(plan.layers)


def test_the_int8_exchange_replaces_zero3s_reduce_scatter_in_the_backward():
    from lazyzero.config import PlanConfig

    profile = made_up_profile()
    collectives = {**profile.machine.collectives,
                   "int8_reduce_scatter": CollectiveSpeed(2, "bfloat16", 1, 1.0, 0.5e-9),
                   "int8_reduce_scatter_error_feedback": CollectiveSpeed(2, "bfloat16", 1, 1.0, 0.75e-9)}
    measured = replace(profile, machine=replace(profile.machine, collectives=collectives))
    settings = PlanConfig(enabled=True, seq_len=8, cpu_mem=4 * 10**9)
    plain = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    base, _ = problem_for_config(measured, plain, settings, 2, 2, process_bytes=0)
    for error_feedback, s_per_byte in ((False, 0.5e-9), (True, 0.75e-9)):
        int8 = {**plain, "lazyzero": {"gradients": {"enabled": True, "error_feedback": error_feedback}}}
        problem, _ = problem_for_config(measured, int8, settings, 2, 2, process_bytes=0)
        full_bytes = 2 * sum(LAYER_TENSORS.values())  # a decoder layer in bf16
        assert problem.layers[0].bwd_s == pytest.approx(base.layers[0].bwd_s + (s_per_byte - 2e-9) * full_bytes)
        assert problem.layers[0].fwd_s == base.layers[0].fwd_s
    # A profile without the int8 figures keeps ZeRO-3's.
    assert problem_for_config(profile, int8, settings, 2, 2, process_bytes=0)[0].layers == \
        problem_for_config(profile, plain, settings, 2, 2, process_bytes=0)[0].layers


def test_lazy_checkpoints_every_n_steps_share_the_windows_with_their_snapshot_traffic(tmp_path):
    from lazyzero.config import PlanConfig
    from lazyzero.plan import solve
    from lazyzero.plan.deepspeed.problem_from_profile import lazy_snapshot_bytes, problem_for_config

    ds_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
                 "lazyzero": {"checkpoint": {"enabled": True}}}
    settings = PlanConfig(enabled=True, seq_len=8, cpu_mem=4 * 10**9, nvme_path=str(tmp_path), checkpoint_every=10)
    problem, _ = problem_for_config(made_up_profile(), ds_config, settings, 2, 2, process_bytes=0)
    snapshot = lazy_snapshot_bytes(made_up_profile(), ds_config, RankShape(2, "bfloat16", True, True))
    assert snapshot > 0 and problem.checkpoint_bytes_per_step == math.ceil(snapshot / 10)
    plan = solve(problem, max_gap=0.0)
    assert sum(plan.checkpoint_transfers) == pytest.approx(problem.checkpoint_bytes_per_step)
    # Without a path to copy over (no GPU, no NVMe tier) there is no traffic to plan.
    no_nvme = settings.model_copy(update={"nvme_path": None})
    assert problem_for_config(made_up_profile(), ds_config, no_nvme, 2, 2,
                              process_bytes=0)[0].checkpoint_bytes_per_step == 0


def test_quality_penalty_follows_the_measured_error_and_the_bound_drops_widths(tmp_path):
    from lazyzero.plan.deepspeed.costs import QUALITY_COST_PER_FWD_S
    from lazyzero.plan.deepspeed.problem_from_profile import QUALITY_COST_PER_ERROR

    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=None, local_ranks=2)
    shape = RankShape(2, "bfloat16", True, True)
    bounded, _ = problem_from_profile(made_up_profile(), budgets, shape, max_grad_error=0.05)
    *decoder, head = bounded.layers
    for costs in decoder:
        errors = GRAD_ERRORS[costs.name]
        assert costs.grad_error == errors
        assert costs.quality_cost == pytest.approx({b: QUALITY_COST_PER_ERROR * e * 0.1 for b, e in errors.items()})
    # The head is never packed: nothing measured, the fixed penalties only keep it at 16 bits.
    assert head.grad_error is None
    assert head.quality_cost == pytest.approx({b: c * 0.1 for b, c in QUALITY_COST_PER_FWD_S.items()})
    # Layer 1's 4-bit error (0.09) is over the bound: that width is not offered to it, nor to it alone.
    assert [c.act_widths for c in bounded.layers] == [(16, 8, 4), (16, 8), (16, 8, 4)]
    assert bounded.layer_widths(1) == (16, 8)
    unbounded, _ = problem_from_profile(made_up_profile(), budgets, shape)
    assert all(c.act_widths == (16, 8, 4) for c in unbounded.layers)


def test_a_planned_run_applies_the_configured_bound():
    from lazyzero.config import PlanConfig
    from lazyzero.plan.deepspeed.problem_from_profile import problem_for_config

    ds_config = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    default = PlanConfig(enabled=True, seq_len=8, cpu_mem=4 * 10**9)
    problem, _ = problem_for_config(made_up_profile(), ds_config, default, 2, 2, process_bytes=0)
    # The default bound (0.02) keeps 8 bits for both layers and drops 4 bits for both (0.03, 0.09).
    assert [c.act_widths for c in problem.layers] == [(16, 8), (16, 8), (16, 8, 4)]
    loose = default.model_copy(update={"max_grad_error": 0.1})
    problem, _ = problem_for_config(made_up_profile(), ds_config, loose, 2, 2, process_bytes=0)
    assert all(c.act_widths == (16, 8, 4) for c in problem.layers)


def test_engine_memory_excess_splits_into_a_fixed_part_and_one_per_layer():
    from lazyzero.plan.deepspeed.calibrate import engine_memory_excess

    # The demo preset's engines, each alone in a process: 57 and 94 MB above the formulas at 1 and 3
    # decoder layers (134 MB measured at 6; the line gives 149.5).
    fixed, per_layer = engine_memory_excess([(3, 94 * MB), (1, 57 * MB)])
    assert (fixed, per_layer) == (pytest.approx(38.5 * MB), pytest.approx(18.5 * MB))
    assert fixed + 6 * per_layer == pytest.approx(149.5 * MB)
    # A line falling with depth is not memory given back: the larger measured excess stays, fixed.
    assert engine_memory_excess([(1, 57 * MB), (3, 40 * MB)]) == (57 * MB, 0.0)
    assert engine_memory_excess([(1, -20 * MB), (3, -30 * MB)]) == (0.0, 0.0)
    # A steep line does not make the fixed part negative.
    assert engine_memory_excess([(1, 10 * MB), (3, 90 * MB)]) == (0.0, pytest.approx(40 * MB))


def test_the_engine_calibration_moves_the_workspace_by_the_excess_at_the_models_depth():
    from lazyzero.plan.deepspeed.calibrate import _cut, _in_memory_prediction
    from lazyzero.plan.profile.data import EngineCalibration, EngineRun

    profile = made_up_profile()
    decoder = replace(profile.layers[0], grad_error=GRAD_ERRORS["model.layers.0"])
    rows = tuple(replace(decoder, name=f"model.layers.{i}", measured_as=f"model.layers.{i}") for i in range(5))
    profile = replace(profile, layers=rows + (profile.layer(EMBED_AND_HEAD),))
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=None, local_ranks=2)
    shape, process = RankShape(2, "bfloat16", True, True), 300 * MB
    plain, _ = problem_from_profile(profile, budgets, shape, process_bytes=process)

    def run(layers, excess):
        """An engine that held `excess` bytes more than the formulas predict for it."""
        _, peak = _in_memory_prediction(_cut(plain, layers))
        before = 400 * MB
        return EngineRun(layers, 1.0, round(before + peak - process + excess), before, 0)

    calibrated = replace(profile, engine=EngineCalibration((run(1, 10 * MB), run(3, 30 * MB)), {}))
    problem, _ = problem_from_profile(calibrated, budgets, shape, process_bytes=process)
    # 10 MB more per decoder layer, held by each decoder layer in memory; nothing fixed.
    assert problem.workspace_bytes - plain.workspace_bytes == pytest.approx(0, abs=2)
    decoders = [c for c in problem.layers if c.name != EMBED_AND_HEAD]
    assert all(c.engine_excess_bytes == pytest.approx(10 * MB, abs=2) for c in decoders)
    from lazyzero.plan.solver.problem import LayerPlan

    in_memory = [LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)] * problem.num_layers
    on_nvme = [LayerPlan("keep", 16, "gpu", "nvme", "nvme", False)] * len(decoders) + in_memory[-1:]
    assert _peak(problem, in_memory) - _peak(plain, in_memory) == pytest.approx(50 * MB, abs=10)
    assert _peak(problem, on_nvme) == pytest.approx(_peak(plain, on_nvme), abs=10)


def _five_layer_profile():
    profile = made_up_profile()
    decoder = replace(profile.layers[0], grad_error=GRAD_ERRORS["model.layers.0"])
    rows = tuple(replace(decoder, name=f"model.layers.{i}", measured_as=f"model.layers.{i}") for i in range(5))
    return replace(profile, layers=rows + (profile.layer(EMBED_AND_HEAD),))


def test_the_nvme_engine_prices_every_nvme_copy_at_the_one_speed_it_measured(tmp_path):
    from lazyzero.plan.deepspeed.calibrate import _cut, _in_memory_prediction, _swapped_prediction
    from lazyzero.plan.profile.data import EngineCalibration, EngineRun

    profile = _five_layer_profile()
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=str(tmp_path), local_ranks=2)
    shape = RankShape(2, "bfloat16", True, True)
    in_memory_runs = (EngineRun(1, 1.0, 0, 0, 0), EngineRun(3, 2.0, 0, 0, 0))
    only_memory, _ = problem_from_profile(replace(profile, engine=EngineCalibration(in_memory_runs, {})), budgets,
                                          shape, process_bytes=0)
    cut = _cut(only_memory, 3)
    assert _in_memory_prediction(cut)[0] == pytest.approx(2.0)
    # The disk test (2 GB/s read, 1 GB/s write) prices the swapped engine's copies at this.
    disk_test_s = _swapped_prediction(cut) - 2.0
    assert disk_test_s > 0
    priced = {}
    for slower in (2.0, 0.5):
        swapped = EngineRun(3, 2.0 + slower * disk_test_s, 0, 0, 0, nvme=True)
        engine = EngineCalibration(in_memory_runs + (swapped,), {})
        problem, _ = problem_from_profile(replace(profile, engine=engine), budgets, shape, process_bytes=0)
        # One speed both ways, at which the swapped engine's copies take what they measured.
        paths = problem.machine.paths
        assert paths["nvme_read"].bytes_per_s == paths["nvme_write"].bytes_per_s
        assert _swapped_prediction(_cut(problem, 3)) == pytest.approx(swapped.step_s)
        assert problem.layers == only_memory.layers and problem.workspace_bytes == only_memory.workspace_bytes
        priced[slower] = paths["nvme_read"].bytes_per_s
    assert priced[0.5] == pytest.approx(4 * priced[2.0])
    assert 1e9 < priced[0.5] and priced[2.0] < 1e9


def test_an_engine_with_parameters_alone_on_nvme_prices_them_apart_from_the_other_copies(tmp_path):
    from lazyzero.plan.deepspeed.calibrate import _cut, _swapped_prediction
    from lazyzero.plan.profile.data import EngineCalibration, EngineRun
    from lazyzero.plan.solver.problem import Placement, blocking_seconds, placement_traffic

    profile = _five_layer_profile()
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=str(tmp_path), local_ranks=2)
    shape = RankShape(2, "bfloat16", True, True)
    in_memory_runs = (EngineRun(1, 1.0, 0, 0, 0), EngineRun(3, 2.0, 0, 0, 0))
    swapped = EngineRun(3, 4.0, 0, 0, 0, nvme=True)
    one_speed, _ = problem_from_profile(replace(profile, engine=EngineCalibration(in_memory_runs + (swapped,), {})),
                                        budgets, shape, process_bytes=0)
    assert one_speed.machine.nvme_param_bytes_per_s is None
    # Parameters alone take half the mixed engine's excess over memory: slower per byte than the mix.
    params_alone = EngineRun(3, 3.0, 0, 0, 0, nvme=True, params_only=True)
    engine = EngineCalibration(in_memory_runs + (swapped, params_alone), {})
    problem, _ = problem_from_profile(replace(profile, engine=engine), budgets, shape, process_bytes=0)
    cut = _cut(problem, 3)
    assert _swapped_prediction(cut, states=False) == pytest.approx(params_alone.step_s)
    param_speed, other_speed = problem.machine.nvme_param_bytes_per_s, problem.machine.paths["nvme_read"].bytes_per_s
    # The other copies keep the speed of the engine with both on NVMe, not what it leaves once the
    # parameters-alone engine is taken out (a difference of two differences: calibrate.nvme_calibrated).
    assert other_speed == pytest.approx(one_speed.machine.paths["nvme_read"].bytes_per_s)
    assert param_speed < other_speed
    assert _swapped_prediction(cut) > swapped.step_s
    # A parameter's copies are priced at their speed, an optimizer state's at the paths'.
    layer = next(i for i, c in enumerate(problem.layers) if c.name != "embed_and_head")
    for traffic in placement_traffic(problem, layer, Placement("nvme", "nvme", False)):
        speed = param_speed if traffic.kind == "param" else other_speed
        assert blocking_seconds(problem, traffic) == pytest.approx(traffic.bytes / speed)
    # An engine with parameters alone no slower than memory (noise) prices them with the rest.
    noise = EngineCalibration(in_memory_runs + (swapped, replace(params_alone, step_s=1.9)), {})
    problem, _ = problem_from_profile(replace(profile, engine=noise), budgets, shape, process_bytes=0)
    # The NVMe tier's capacity is the disk's free space when each problem is built: another process
    # writing meanwhile moves it, so the tiers are compared by name and the rest whole.
    assert problem.machine.tiers.keys() == one_speed.machine.tiers.keys()
    assert replace(problem.machine, tiers=one_speed.machine.tiers) == one_speed.machine


def test_an_nvme_engine_no_slower_than_memory_or_a_run_without_nvme_keeps_the_disk_test(tmp_path):
    from lazyzero.plan.profile.data import EngineCalibration, EngineRun

    profile = _five_layer_profile()
    shape = RankShape(2, "bfloat16", True, True)
    in_memory_runs = (EngineRun(1, 1.0, 0, 0, 0), EngineRun(3, 2.0, 0, 0, 0))
    with_nvme = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=str(tmp_path), local_ranks=2)
    disk_test, _ = problem_from_profile(replace(profile, engine=EngineCalibration(in_memory_runs, {})), with_nvme,
                                        shape, process_bytes=0)
    noise = EngineCalibration(in_memory_runs + (EngineRun(3, 1.9, 0, 0, 0, nvme=True),), {})
    problem, _ = problem_from_profile(replace(profile, engine=noise), with_nvme, shape, process_bytes=0)
    assert problem.machine.paths == disk_test.machine.paths
    without_nvme = replace(with_nvme, nvme_path=None)
    slow = EngineCalibration(in_memory_runs + (EngineRun(3, 50.0, 0, 0, 0, nvme=True),), {})
    problem, _ = problem_from_profile(replace(profile, engine=slow), without_nvme, shape, process_bytes=0)
    assert "nvme" not in problem.machine.tiers


def _peak(problem, layers) -> float:
    """The simulated compute-memory peak of `layers`, on the problem's machine with an NVMe tier added."""
    from lazyzero.plan.solver.problem import Path, Tier
    from lazyzero.plan.solver.simulate import evaluate_layers

    machine = problem.machine
    nvme = replace(machine, tiers={**machine.tiers, "nvme": Tier("nvme", 10**12)},
                   paths={**machine.paths, "nvme_read": Path("nvme_read", 1e9), "nvme_write": Path("nvme_write", 1e9)})
    return evaluate_layers(replace(problem, machine=nvme), layers, "greedy").predicted_peak_bytes["gpu"]


def test_the_engine_line_runs_through_the_shallowest_and_the_deepest_engine():
    """With an engine at the model's own depth, the calibrated problem predicts what that engine took
    at that depth; the engine of 3 layers between them moves nothing."""
    from lazyzero.plan.deepspeed.calibrate import _cut, _in_memory_prediction
    from lazyzero.plan.profile.data import EngineCalibration, EngineRun

    profile = _five_layer_profile()
    budgets = Budgets(cpu_mem=4 * 10**9, gpu_mem=None, nvme_path=None, local_ranks=2)
    shape = RankShape(2, "bfloat16", True, True, torch_adam=True)
    plain, _ = problem_from_profile(profile, budgets, shape, process_bytes=0)
    predicted = {n: _in_memory_prediction(_cut(plain, n))[0] for n in (1, 3, 5)}
    over = {1: 0.5, 3: 0.7, 5: 1.5}
    runs = tuple(EngineRun(n, predicted[n] + over[n], 0, 0, 0) for n in (3, 5, 1))
    problem, _ = problem_from_profile(replace(profile, engine=EngineCalibration(runs, {})), budgets, shape,
                                      process_bytes=0)
    assert _in_memory_prediction(problem)[0] == pytest.approx(predicted[5] + 1.5)
    # Without the deepest engine the line through 1 and 3 layers gives 0.9 s over the prediction at 5.
    shallow, _ = problem_from_profile(replace(profile, engine=EngineCalibration(runs[::2], {})), budgets, shape,
                                      process_bytes=0)
    assert _in_memory_prediction(shallow)[0] == pytest.approx(predicted[5] + 0.9)
    with pytest.raises(ValueError, match="distinct layer counts"):
        problem_from_profile(replace(profile, engine=EngineCalibration(runs + runs[:1], {})), budgets, shape,
                             process_bytes=0)
