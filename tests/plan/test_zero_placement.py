"""Per-layer ZeRO-3 tiers (lazyzero/plan/deepspeed/zero_placement.py): optimizer state and bf16 parameters of
chosen layers on NVMe, the rest in memory.

Real runs: 2 ranks, tests/plan/placement_worker.py (a hidden-1024 Llama of 2 layers, bf16,
clipping active). Unless "wide", every parameter is its own sub-group, so every run below cuts the
same sub-groups and only their tiers differ: then training must not change by a bit. The
bit-comparable baselines are `offload_optimizer.device: cpu` (the same CPU optimizer stepping the
same fp32 partitions in host memory) and DeepSpeed's own all-NVMe run. Without offload DeepSpeed
steps its Adam with FusedAdam instead of CPU Adam, which is not (measured: losses differ from step 3
on); lazyzero's 8-bit optimizer is the same class either way, and there it is bit-equal too.
"""

import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from lazyzero.config.errors import LazyZeroConfigError
from lazyzero.plan.deepspeed.zero_placement import (
    ZeroPlacement,
    check_placement_names,
    names_under,
    placement_problems,
    zero_placement,
)
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "placement_worker.py"
# DeepSpeed swaps a partition only from max(1 MiB, aio.block_size) up (both swappers).
MIN_SWAP_BYTES = 1 << 20
TIERED_NORM = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3._get_norm_groups"

needs_libaio = pytest.mark.skipif(not Path("/usr/include/libaio.h").exists(),
                                  reason="NVMe offload needs libaio-dev (.ci/run installs it)")


def launch(out: Path, *specs: str) -> dict[str, list[dict]]:
    """Run the worker's SPECs in one 2-rank launch; {name: [rank 0 record, rank 1 record]}."""
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(out), *specs], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    names = [spec.split(":")[0] for spec in specs]
    return {name: [json.loads((out / f"{name}_rank{rank}.json").read_text()) for rank in (0, 1)] for name in names}


def on_nvme(name: str, layers: tuple[int, ...]) -> bool:
    return any(name.startswith(f"model.layers.{layer}.") for layer in layers)


def assert_optimizer_swapped_exactly(record: dict, nvme_layers: tuple[int, ...]) -> None:
    """Sub-groups never mix tiers; those on NVMe and large enough to swap (and only those) have
    their fp32 master and moment files; every other sub-group has none."""
    ids_with_files = {file.split(".")[0].split("_gradient")[0].split("-")[-1] for file in record["optimizer_files"]}
    expected = set()
    for group in record["sub_groups"]:
        tiers = {on_nvme(name, nvme_layers) for name in group["names"]}
        assert len(tiers) == 1, group
        should_swap = tiers == {True} and 4 * group["numel"] >= MIN_SWAP_BYTES
        assert group["swapped"] == should_swap, group
        if should_swap:
            expected.add(group["ds_id"])
            files = set(record["optimizer_files"])
            fp32_moments = {f"exp_avg-{group['ds_id']}.tensor.swp", f"exp_avg_sq-{group['ds_id']}.tensor.swp"}
            assert f"{group['ds_id']}.tensor.swp" in files, (group, files)
            assert fp32_moments <= files or f"{group['ds_id']}.adam8bit.swp" in files, (group, files)
    assert expected, "no sub-group was swapped: the model is too small to test anything"
    assert ids_with_files == expected


def assert_params_swapped_exactly(record: dict, nvme_layers: tuple[int, ...]) -> None:
    """bf16 partition files exist for the NVMe layers' weight matrices, for nothing else."""
    expected = {f"{ds_id}_param.tensor.swp" for name, ds_id in record["ds_ids"].items()
                if on_nvme(name, nvme_layers) and "layernorm" not in name}
    assert expected and set(record["param_files"]) == expected


# --- default suite: one launch -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiered_runs(tmp_path_factory):
    """Layer 1's optimizer state and bf16 parameters on NVMe (saved after 3 steps), everything in
    memory, DeepSpeed's own run with all of it on NVMe, a resume of the first from its checkpoint, and
    a check of that checkpoint under another placement (layer 0 on NVMe)."""
    out = tmp_path_factory.mktemp("placement")
    return launch(out, "half:adam:tiered:1:params,save", "memory:adam:cpu:-", "nvme:adam:nvme:-",
                  "resume:adam:tiered:1:params,resume=half", "other:adam:tiered:0:params,check=half")


@pytest.mark.multiproc
@needs_libaio
def test_only_the_placed_layers_have_swap_files(tiered_runs):
    for record in tiered_runs["half"]:
        assert_optimizer_swapped_exactly(record, nvme_layers=(1,))
        assert_params_swapped_exactly(record, nvme_layers=(1,))
        report = record["tier_report"]
        assert report["optimizer_nvme_elements"] > 0 and report["param_nvme_elements"] > 0
        # The norm weights of layer 1 are placed on NVMe but too small for DeepSpeed's swapper.
        assert report["optimizer_nvme_too_small"] == ["model.layers.1.input_layernorm.weight",
                                                      "model.layers.1.post_attention_layernorm.weight"]


@pytest.mark.multiproc
@needs_libaio
def test_the_planner_counts_deepspeeds_swap_buffers(tiered_runs):
    """The host memory the planner reserves for DeepSpeed's NVMe swappers (swap_buffers.py) is what
    their buffers hold: the optimizer swapper's 4 fp32 buffers of the largest sub-group, and the
    parameter swapper's pool (8 x 1.1M bf16 elements here) and partitioned buffer."""
    from lazyzero.plan.deepspeed.swap_buffers import optimizer_swap_bytes, parameter_swap_bytes

    for record in tiered_runs["half"]:
        largest = max(group["numel"] for group in record["sub_groups"])
        held = record["swap_buffer_bytes"]
        assert held["optimizer"] == optimizer_swap_bytes(largest, 4)
        assert held["parameters"] == parameter_swap_bytes(buffer_count=8, buffer_size=1_100_000,
                                                          largest_group_numel=largest, world_size=2, dtype_bytes=2)


@pytest.mark.multiproc
@needs_libaio
def test_half_on_nvme_trains_bit_for_bit_like_all_in_memory(tiered_runs):
    for half, memory in zip(tiered_runs["half"], tiered_runs["memory"]):
        # Clipping is active (norms ~12 > 1.0), so the clip factor, and the order in which the
        # sub-group norms are combined, matter.
        assert min(half["grad_norms"]) > 1.0
        assert half["grad_norms"] == memory["grad_norms"]
        assert half["losses"] == memory["losses"]
        assert half["digest"] == memory["digest"]


@pytest.mark.multiproc
@needs_libaio
def test_placed_layers_step_from_host_gradients_with_deepspeeds_bits(tiered_runs):
    """DeepSpeed writes a swapped sub-group's gradients to NVMe and reads them back for the step; the
    planner's optimizer steps them from DeepSpeed's flat gradient partition (resident_gradients.py):
    no gradient file, and the same bits as DeepSpeed's own NVMe run and the run in memory."""
    for half, nvme, memory in zip(tiered_runs["half"], tiered_runs["nvme"], tiered_runs["memory"]):
        assert any(gradient_file(name) for name in nvme["optimizer_files"]), nvme["optimizer_files"]
        assert not any(gradient_file(name) for name in half["optimizer_files"]), half["optimizer_files"]
        assert half["losses"] == nvme["losses"] == memory["losses"]
        assert half["grad_norms"] == nvme["grad_norms"]
        assert half["digest"] == nvme["digest"] == memory["digest"]


def gradient_file(name: str) -> bool:
    # DeepSpeed's optimizer swapper names a sub-group's gradient files <ds_id>_gradient_<offset>...
    return "_gradient" in name


@pytest.mark.multiproc
@needs_libaio
def test_resume_repeats_the_uninterrupted_run(tiered_runs):
    for half, resumed in zip(tiered_runs["half"], tiered_runs["resume"]):
        assert resumed["losses"] == half["losses"][3:]
        assert resumed["digest"] == half["digest"]


@pytest.mark.multiproc
@needs_libaio
def test_a_checkpoint_saved_under_another_placement_is_refused(tiered_runs):
    for resumed, other in zip(tiered_runs["resume"], tiered_runs["other"]):
        assert resumed["check"] == "ok"
        # Both layers have the same shapes, so only the sub-groups' parameter ids tell them apart.
        assert "holds ZeRO parameters" in other["check"], other["check"]
        assert other["check"].endswith("resume with the placement and sub_group_size the checkpoint was saved with")


# --- slow: the 8-bit optimizer, DeepSpeed's own NVMe run, other sub-group sizes, misuse ------------

@pytest.mark.slow
@pytest.mark.multiproc
@needs_libaio
def test_8bit_optimizer_half_on_nvme_equals_all_nvme_and_none_and_resumes(tmp_path):
    runs = launch(tmp_path, "half:adam8bit:tiered:1:save", "nvme:adam8bit:nvme:-", "memory:adam8bit:cpu:-",
                  "resume:adam8bit:tiered:1:resume=half", "params:adam8bit:tiered:1:params")
    for rank in (0, 1):
        half = runs["half"][rank]
        assert_optimizer_swapped_exactly(half, nvme_layers=(1,))
        assert any(file.endswith(".adam8bit.swp") for file in half["optimizer_files"])
        for other in ("nvme", "memory", "params"):
            assert runs[other][rank]["losses"] == half["losses"], other
            assert runs[other][rank]["digest"] == half["digest"], other
        assert runs["resume"][rank]["losses"] == half["losses"][3:]
        assert runs["resume"][rank]["digest"] == half["digest"]
        assert_params_swapped_exactly(runs["params"][rank], nvme_layers=(1,))
        # Fused clipping (gradient_clipping 1.0) replaced the tiered optimizer's norm order, and said why.
        for composed in ("half", "params"):
            assert runs[composed][rank]["replaced_over_override"] == [TIERED_NORM], composed
        assert runs["nvme"][rank]["replaced_over_override"] == []


@pytest.mark.slow
@pytest.mark.multiproc
@needs_libaio
def test_placement_of_every_parameter_is_deepspeeds_own_nvme_run(tmp_path):
    runs = launch(tmp_path, "every:adam:tiered:all", "nvme:adam:nvme:-", "half:adam:tiered:1", "memory:adam:cpu:-")
    for rank in (0, 1):
        every, nvme = runs["every"][rank], runs["nvme"][rank]
        # The same state files; DeepSpeed's run also wrote its gradients, the placement's kept them.
        assert every["optimizer_files"] == [name for name in nvme["optimizer_files"] if not gradient_file(name)]
        assert not any(gradient_file(name) for name in every["optimizer_files"])
        assert [group["swapped"] for group in every["sub_groups"]] == [group["swapped"] for group in nvme["sub_groups"]]
        for other in ("nvme", "half", "memory"):
            assert runs[other][rank]["losses"] == every["losses"], other
            assert runs[other][rank]["digest"] == every["digest"], other
        assert_optimizer_swapped_exactly(runs["half"][rank], nvme_layers=(1,))


@pytest.mark.slow
@pytest.mark.multiproc
@needs_libaio
def test_wide_sub_groups_cut_between_tiers_and_resume_exactly(tmp_path):
    """sub_group_size 1e6: DeepSpeed would put layer 0's norms and layer 1's first matrices in one
    sub-group; the placement cuts between them. Training then differs from an all-in-memory run in
    the rounding of the grad norm (as DeepSpeed's own runs differ between sub_group_size values),
    but stays exactly resumable."""
    runs = launch(tmp_path, "half:adam:tiered:1:wide,params,save", "resume:adam:tiered:1:wide,params,resume=half",
                  "half8:adam8bit:tiered:1:wide,save", "resume8:adam8bit:tiered:1:wide,resume=half8")
    for rank in (0, 1):
        for half, resumed in (("half", "resume"), ("half8", "resume8")):
            assert_optimizer_swapped_exactly(runs[half][rank], nvme_layers=(1,))
            assert runs[resumed][rank]["losses"] == runs[half][rank]["losses"][3:]
            assert runs[resumed][rank]["digest"] == runs[half][rank]["digest"]
        assert_params_swapped_exactly(runs["half"][rank], nvme_layers=(1,))
        assert any(len(group["names"]) > 1 for group in runs["half"][rank]["sub_groups"])


@pytest.mark.slow
@pytest.mark.multiproc
@needs_libaio
def test_engine_refuses_placements_its_settings_cannot_realize(tmp_path):
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(tmp_path), "errors"], timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    errors = json.loads((tmp_path / "errors_rank0.json").read_text())
    assert errors["optimizer_device_cpu"].startswith("LazyZeroConfigError")
    assert "zero_optimization.offload_optimizer.device: got 'cpu'; allowed: 'nvme'" in errors["optimizer_device_cpu"]
    assert errors["stage_2"].startswith("LazyZeroConfigError")
    assert "zero_optimization.stage: a ZeRO placement needs stage 3" in errors["stage_2"]
    assert ("zero_optimization.offload_param.device: got 'none'; allowed: 'nvme'"
            in errors["params_without_offload_param"])
    assert "model.layers.1.mlp.upp_proj.weight" in errors["unknown_name"]
    assert "deepspeed.zero.Init" in errors["zero_init_model"]


# --- in-process: the placement object and its checks -----------------------------------------------

def zero_config(**settings) -> DeepSpeedZeroConfig:
    return DeepSpeedZeroConfig(**{"stage": 3, **settings})


NVME = {"device": "nvme", "nvme_path": "/var/tmp"}
LAYER_1 = ZeroPlacement(optimizer_nvme=frozenset({"model.layers.1.mlp.up_proj.weight"}))
LAYER_1_PARAMS = ZeroPlacement(param_nvme=frozenset({"model.layers.1.mlp.up_proj.weight"}))


def test_module_names_match_whole_path_components():
    names = ["model.layers.1.mlp.up_proj.weight", "model.layers.10.mlp.up_proj.weight", "model.layers.1",
             "lm_head.weight"]
    assert names_under(names, ["model.layers.1"]) == {"model.layers.1.mlp.up_proj.weight", "model.layers.1"}
    placement = ZeroPlacement.from_modules(names, ["lm_head"], ["model.layers.10"])
    assert placement == ZeroPlacement(frozenset({"lm_head.weight"}), frozenset({"model.layers.10.mlp.up_proj.weight"}))
    assert ZeroPlacement.from_modules(names, ["lm_head"]).param_nvme is None


def test_settings_that_cannot_realize_the_placement_are_named():
    assert placement_problems(LAYER_1, zero_config(offload_optimizer=NVME)) == []
    assert placement_problems(ZeroPlacement(), zero_config(stage=2)) != []
    [problem] = placement_problems(LAYER_1, zero_config(offload_optimizer={"device": "cpu"}))
    assert problem.path == "zero_optimization.offload_optimizer.device" and "got 'cpu'; allowed: 'nvme'" in problem.text
    [problem] = placement_problems(LAYER_1, zero_config())
    assert problem.path == "zero_optimization.offload_optimizer.device" and "got 'none'" in problem.text
    [problem] = placement_problems(LAYER_1_PARAMS, zero_config(offload_optimizer=NVME))
    assert problem.path == "zero_optimization.offload_param.device"
    assert placement_problems(LAYER_1_PARAMS, zero_config(offload_optimizer=NVME, offload_param=NVME)) == []
    paths = [p.path for p in placement_problems(LAYER_1, zero_config(stage=2, offload_optimizer={"device": "cpu"}))]
    assert paths == ["zero_optimization.stage", "zero_optimization.offload_optimizer.device"]
    super_offload = zero_config(offload_optimizer={**NVME, "super_offload": True})
    [problem] = placement_problems(LAYER_1, super_offload)
    assert problem.path == "zero_optimization.offload_optimizer.super_offload"


def test_the_stage_3_class_is_replaced_only_inside_the_context():
    from deepspeed.runtime.zero import stage3

    original = stage3.DeepSpeedZeroOptimizer_Stage3
    with zero_placement(None, zero_config()):
        assert stage3.DeepSpeedZeroOptimizer_Stage3 is original
    with pytest.raises(LazyZeroConfigError, match="zero_optimization.stage: .*no ZeRO-3 optimizer was built"):
        with zero_placement(LAYER_1):
            assert stage3.DeepSpeedZeroOptimizer_Stage3 is not original
    assert stage3.DeepSpeedZeroOptimizer_Stage3 is original
    with pytest.raises(LazyZeroConfigError, match="offload_optimizer.device"):
        with zero_placement(LAYER_1, zero_config()):
            pass
    assert stage3.DeepSpeedZeroOptimizer_Stage3 is original


def test_unknown_names_and_models_zero_init_put_on_nvme_are_refused():
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    param_names = {param: name for name, param in model.named_parameters()}
    check_placement_names(ZeroPlacement(frozenset({"0.weight"}), frozenset({"0.bias"})), param_names, model)
    with pytest.raises(ValueError, match=r"does not have: 0\.wieght"):
        check_placement_names(ZeroPlacement(frozenset({"0.wieght"})), param_names, model)
    # What zero.Init leaves on a parameter it has partitioned into memory: the placement moves it.
    model[0].weight.ds_id, model[0].weight.ds_tensor = 0, torch.zeros(2)
    model[0].weight.ds_tensor.final_location = None
    check_placement_names(ZeroPlacement(param_nvme=frozenset({"0.weight"})), param_names, model)
    model[0].weight.ds_tensor.final_location = OffloadDeviceEnum.nvme  # zero.Init's own offload_param: nvme
    with pytest.raises(ValueError, match="zero.Init without offload_param"):
        check_placement_names(ZeroPlacement(param_nvme=frozenset({"0.weight"})), param_names, model)
