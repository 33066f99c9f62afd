"""The planning problem of one ZeRO-3 rank, from a measured profile (docs/plan.md).

`problem_from_profile` turns a `ModelProfile` (what one rank measured for one micro-batch) and the
budgets into a `PlanProblem`, in the bytes and seconds of one rank of a `world_size`-rank ZeRO-3 job:
- parameters, gradients and optimizer states are the rank's partitions (1/world_size of each tensor,
  rounded up); 16-bit parameters and gradients in the model's dtype; Adam's fp32 master weights are
  counted only under mixed precision (an fp32 model's parameters are its master weights);
- a layer's forward is its measured compute plus one all-gather of its parameters, its backward the
  measured backward plus another all-gather (parameters are released after each use) and the
  reduce-scatter of its gradients (measured collectives, linear in bytes);
- activations, recompute and packing costs are the measured ones; a reduced width's quality penalty is
  in proportion to its measured gradient error on the layer, and a width whose error exceeds
  `plan.max_grad_error` is not offered to that layer at all;
- the optimizer's speed per state byte is the measured step of the optimizer that will run: lazyzero's
  8-bit step where states are 8-bit, DeepSpeed's CPU Adam under optimizer offload, torch's AdamW on
  the device;
- the workspace is what the rank holds whatever the plan: the process itself (measured resident set
  less the model it held when profiled), two layers of gathered parameters, the embedding and head's
  gathered parameters and saved tensors, a layer's temporaries, one reduce bucket, the optimizer's
  fp32 gradient copy of one sub-group and, when the optimizer is swapped to NVMe, the swapper's
  buffers (swap_buffers.py); the parameter swapper's buffers are `PlanProblem.param_swap_bytes`,
  held only by plans that put parameters on NVMe; the other lazyzero features' memory is added after
  the engine calibration, and lazy checkpoints' snapshot memory, which depends on the plan's state
  formats, is `PlanProblem.snapshot`.
Tiers: on a machine without a GPU, "gpu" is the rank's share of the host memory budget (the memory
training computes in) and "nvme" its share of the NVMe folder's free space; on CUDA, "gpu" is the
device budget, "cpu" the rank's share of host memory.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, replace

from lazyzero.checkpoint.config import CheckpointConfig
from lazyzero.plan.deepspeed.calibrate import engine_calibrated, headroom_budget, with_compute_capacity
from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD, FP32_BYTES, QUALITY_COST_PER_FWD_S, optimizer_state_bytes
from lazyzero.plan.deepspeed.implied import OPTIMIZER_SWAP_BUFFERS, PARAM_SWAP_BUFFERS_PER_TENSOR, ModelSizes
from lazyzero.plan.deepspeed.swap_buffers import largest_sub_group_bound, optimizer_swap_bytes, parameter_swap_bytes
from lazyzero.plan.profile.data import LayerProfile, ModelProfile
from lazyzero.plan.solver.problem import BIT_WIDTHS, LayerCosts, Machine, Path, PlanProblem, SnapshotMemory, Tier

# Quality penalty of a reduced width, in seconds-equivalent: this constant x the width's measured
# gradient error on the layer (LayerProfile.grad_error) x the layer's forward seconds. It keeps the
# scale of the fixed penalties the analytic presets use (costs.QUALITY_COST_PER_FWD_S, 1e-4 and 2e-3
# per forward second at 8 and 4 bits) for the errors of the randomly initialized demo preset, whose
# median layer measures 0.0032 at 8 bits and 0.047 at 4 (docs/plan.md, "Quality"): 0.04 x those is
# 1.3e-4 and 1.9e-3. So a width is still lowered whenever that saves time or makes a plan fit, 16 bits
# wins a tie, and between layers the planner now narrows those its measurement says suffer least.
QUALITY_COST_PER_ERROR = 0.04
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Budgets:
    """Per-node budgets in bytes (None: the machine's own), split evenly among `local_ranks`;
    `reserve`: the share of the compute memory's budget that plans leave free."""

    cpu_mem: int | None
    gpu_mem: int | None
    nvme_path: str | None
    local_ranks: int
    reserve: float = 0.0


@dataclass(frozen=True)
class RankShape:
    """How the profiled model is trained: ranks, parameter dtype, mixed precision, DeepSpeed buckets."""

    world_size: int
    dtype: str
    mixed_precision: bool
    eight_bit_allowed: bool
    torch_adam: bool = False
    """The config's Adam/AdamW asks for torch's (`"torch_adam": true`): DeepSpeed then builds
    torch.optim.AdamW even where the optimizer is offloaded, in place of its CPU Adam
    (`uses_torch_adam`)."""


def problem_from_profile(profile: ModelProfile, budgets: Budgets, shape: RankShape, *,
                         allowed_bits=BIT_WIDTHS, allow_recompute: bool = True, max_grad_error: float | None = None,
                         process_bytes: int | None = None, feature_bytes: int = 0) -> tuple[PlanProblem, ModelSizes]:
    """The problem, corrected by the profile's engine calibration when it has one (calibrate.py).
    `feature_bytes`: what the run's other lazyzero features hold whatever the plan
    (`feature_workspace_bytes`), added to the workspace. `max_grad_error`: widths whose measured
    gradient error on a layer exceeds it are not offered to that layer (`LayerCosts.act_widths`;
    None: no bound).

    `process_bytes`: what the rank holds besides the model and the engine, measured just before the
    engine is built (the profile's leftovers and the training loop's data included); None: from the
    profile's own snapshot at its start."""
    machine = _machine(profile, budgets, shape)
    offloaded_grads = machine.nvme_state_takes_grads
    layers = tuple(_layer_costs(profile, row, shape, offloaded_grads, max_grad_error) for row in profile.layers)
    if process_bytes is None:
        process_bytes = max(0, profile.memory.rss_bytes - profile.memory.param_bytes)
    workspace = process_bytes + _engine_workspace_bytes(profile, shape, offloaded_grads)
    swappers = _swapper_bytes(profile, shape)
    if offloaded_grads:
        # The optimizer is always swapped to NVMe here (implied.py): its buffers are there all along,
        # not only while a layer's state is stepped (so `_layer_costs` stages nothing per layer).
        workspace += swappers["optimizer"]
    problem = PlanProblem(layers, machine, workspace, allowed_bits=tuple(allowed_bits),
                          allow_recompute=allow_recompute, allow_8bit_optimizer=shape.eight_bit_allowed,
                          param_tiers=_parameter_tiers(machine, shape), offload_all_or_none=machine.has_host,
                          param_swap_bytes=swappers["parameters"] if "nvme" in machine.tiers else 0)
    if profile.engine is not None:
        problem = engine_calibrated(problem, profile, process_bytes)
    # After the calibration: its engines ran without a "lazyzero" section (implied.calibration_ds_config),
    # so what the features hold is no part of what they measured.
    problem = replace(problem, workspace_bytes=problem.workspace_bytes + feature_bytes)
    return problem, model_sizes(profile, shape.world_size)


def _parameter_tiers(machine: Machine, shape: RankShape) -> tuple[str, ...] | None:
    if "nvme" in machine.tiers and not nvme_swaps_parameters(shape.dtype, on_gpu=machine.has_host):
        return tuple(t for t in machine.tiers if t != "nvme")
    return None


def nvme_swaps_parameters(dtype: str, on_gpu: bool) -> bool:
    """Whether DeepSpeed 0.19.8 can swap parameters of `dtype` ("float32", "bfloat16", ...) to NVMe: not
    fp32 ones on its CPU accelerator (it builds the swapper for bf16: "Float and BFloat16",
    docs/deepspeed-internals.md), so an fp32 model there keeps them in memory."""
    return on_gpu or dtype != "float32"


def _swapper_bytes(profile: ModelProfile, shape: RankShape) -> dict[str, int]:
    """Host bytes of DeepSpeed's NVMe optimizer and parameter swappers under the ZeRO-3 settings
    implied.py writes (swap_buffers.py), for the aio default of one thread per request."""
    sizes = model_sizes(profile, shape.world_size)
    largest_tensor = math.ceil(sizes.largest_tensor_numel / shape.world_size)
    total = sum(_partition_numel(row, shape.world_size) for row in profile.layers)
    group = largest_sub_group_bound(math.ceil(sizes.largest_layer_numel / shape.world_size), largest_tensor, total)
    return {"optimizer": optimizer_swap_bytes(group, OPTIMIZER_SWAP_BUFFERS),
            "parameters": parameter_swap_bytes(
                buffer_count=PARAM_SWAP_BUFFERS_PER_TENSOR * sizes.tensors_per_layer,
                buffer_size=largest_tensor, largest_group_numel=group,
                world_size=shape.world_size, dtype_bytes=_DTYPE_BYTES[shape.dtype])}


def model_sizes(profile: ModelProfile, world_size: int) -> ModelSizes:
    decoder = [row for row in profile.layers if row.name != EMBED_AND_HEAD]
    return ModelSizes(largest_layer_numel=max(row.param_numel for row in decoder),
                      largest_tensor_numel=max(t.numel for row in profile.layers for t in row.tensors.values()),
                      tensors_per_layer=max(len(row.tensors) for row in decoder), world_size=world_size)


def _partition_numel(row: LayerProfile, world_size: int) -> int:
    return sum(math.ceil(t.numel / world_size) for t in row.tensors.values())


def _collective_s(profile: ModelProfile, name: str, full_bytes: float) -> float:
    speed = profile.machine.collectives.get(name)
    return 0.0 if speed is None else speed.s_per_byte * full_bytes


def _layer_costs(profile: ModelProfile, row: LayerProfile, shape: RankShape, offloaded_grads: bool,
                 max_grad_error: float | None) -> LayerCosts:
    """One layer's costs on one rank. `offloaded_grads`: the optimizer is offloaded (to NVMe, on a
    machine without a GPU), so DeepSpeed keeps every gradient partition in fp32."""
    dtype_bytes = _DTYPE_BYTES[shape.dtype]
    partition = _partition_numel(row, shape.world_size)
    full_bytes = row.param_numel * dtype_bytes
    gather = _collective_s(profile, "all_gather", full_bytes)
    scatter = _collective_s(profile, "reduce_scatter", full_bytes)
    numels = {name: t.numel for name, t in row.tensors.items()}
    master = FP32_BYTES if shape.mixed_precision else 0
    decoder = row.name != EMBED_AND_HEAD
    # The head saves what it saves at every width (its logits feed the loss in fp32) and cannot be
    # recomputed by the runtime: a recompute that keeps as much as it saves is never chosen.
    act = {bits: row.act_bytes[bits] if decoder else row.act_bytes[16] for bits in BIT_WIDTHS}
    # What packing adds (0 at 16 bits, where the packer keeps tensors as saved, and for the head).
    pack_fwd = {bits: max(0.0, row.packed_fwd_s[bits] - row.fwd_s) if decoder and bits != 16 else 0.0
                for bits in BIT_WIDTHS}
    pack_bwd = {bits: max(0.0, row.packed_bwd_s[bits] - row.bwd_s) if decoder and bits != 16 else 0.0
                for bits in BIT_WIDTHS}
    recompute = row.recompute_s if row.recompute_s is not None else row.fwd_s
    stage = 0 if offloaded_grads else OPTIMIZER_SWAP_BUFFERS * partition * FP32_BYTES
    offload_fwd, offload_bwd = _offload_work(row, act) if decoder else ({}, {})
    return LayerCosts(
        name=row.name, fwd_s=row.fwd_s + gather, bwd_s=row.bwd_s + gather + scatter,
        act_bytes=act, input_bytes=row.input_bytes if decoder else act[16],
        param_bytes=partition * dtype_bytes, grad_bytes=partition * (FP32_BYTES if offloaded_grads else dtype_bytes),
        optim_state_bytes_fp32=optimizer_state_bytes(numels, False, master_bytes=master, world_size=shape.world_size),
        optim_state_bytes_8bit=optimizer_state_bytes(numels, True, master_bytes=master, world_size=shape.world_size),
        quality_cost=_quality_cost(row), act_widths=within_error_bound(row, max_grad_error),
        grad_error=dict(row.grad_error) if decoder else None,
        pack_fwd_s=pack_fwd, pack_bwd_s=pack_bwd, recompute_s=recompute,
        **({"offload_fwd_s": offload_fwd, "offload_bwd_s": offload_bwd} if offload_fwd else {}),
        # DeepSpeed's NVMe optimizer swapper stages its buffers of one fp32 partition each; where the
        # optimizer is always swapped, its buffers are in the workspace instead.
        stage_bytes_fp32=stage, stage_bytes_8bit=stage)


def _quality_cost(row: LayerProfile) -> dict[int, float]:
    """Per width, QUALITY_COST_PER_ERROR x the measured gradient error x the forward seconds. The head
    is never packed (the same bytes at every width, nothing measured): the analytic presets' fixed
    penalties only break its tie, at 16 bits."""
    if row.name == EMBED_AND_HEAD:
        return {bits: QUALITY_COST_PER_FWD_S[bits] * row.fwd_s for bits in BIT_WIDTHS}
    return {bits: QUALITY_COST_PER_ERROR * row.grad_error[bits] * row.fwd_s for bits in BIT_WIDTHS}


def within_error_bound(row: LayerProfile, max_grad_error: float | None) -> tuple[int, ...]:
    """The widths whose measured gradient error on this layer is within `max_grad_error` (all when
    None); 16, exact, always."""
    return tuple(bits for bits in BIT_WIDTHS
                 if bits == 16 or max_grad_error is None or row.grad_error[bits] <= max_grad_error)


def _offload_work(row: LayerProfile, act: dict[int, int]) -> tuple[dict, dict]:
    """Seconds that offloading the stored activations adds, per width: what the profile measured at
    16 bits beyond the packer alone, in proportion to the bytes moved at each width ({} when the
    profile has no NVMe measurement)."""
    if row.offloaded_fwd_s is None or row.offloaded_bwd_s is None or not act[16]:
        return {}, {}
    extra_fwd = max(0.0, row.offloaded_fwd_s - row.packed_fwd_s[16])
    extra_bwd = max(0.0, row.offloaded_bwd_s - row.packed_bwd_s[16])
    return ({bits: extra_fwd * act[bits] / act[16] for bits in BIT_WIDTHS},
            {bits: extra_bwd * act[bits] / act[16] for bits in BIT_WIDTHS})


def _engine_workspace_bytes(profile: ModelProfile, shape: RankShape, offloaded_grads: bool) -> int:
    """What the engine holds whatever the plan: two layers of gathered parameters and the head's, a
    layer's temporaries, one reduce bucket, the optimizer's fp32 gradient copy of one sub-group, the
    tensors saved once per forward and, when the optimizer is offloaded, DeepSpeed's flat gradient
    partition in the model's dtype (for every layer, beside the fp32 copies `grad_bytes` counts)."""
    dtype_bytes = _DTYPE_BYTES[shape.dtype]
    decoder = [row for row in profile.layers if row.name != EMBED_AND_HEAD]
    head = profile.layer(EMBED_AND_HEAD)
    largest = max(row.param_numel for row in decoder)
    gathered = (2 * largest + head.param_numel) * dtype_bytes
    transient = max((row.transient_fwd_bytes or 0, row.transient_bwd_bytes or 0) for row in profile.layers)
    reduce_bucket = largest * dtype_bytes
    fp32_grad_copy = math.ceil(largest / shape.world_size) * FP32_BYTES
    shared = max(profile.shared_saved_bytes.values(), default=0)
    flat_grads = sum(_partition_numel(row, shape.world_size) for row in profile.layers) * dtype_bytes
    return round(gathered + max(transient) + reduce_bucket + fp32_grad_copy + shared
                 + (flat_grads if offloaded_grads else 0))


def _machine(profile: ModelProfile, budgets: Budgets, shape: RankShape) -> Machine:
    measured = profile.machine
    per_rank = max(1, budgets.local_ranks)
    host = budgets.cpu_mem if budgets.cpu_mem is not None else measured.host_memory_bytes
    tiers, paths = {}, {}
    if measured.device_type == "cuda":
        if budgets.gpu_mem is None:
            raise ValueError("lazyzero.plan.gpu_mem: needed on CUDA (the device's memory is not in the profile)")
        tiers["gpu"] = Tier("gpu", round(budgets.gpu_mem * (1 - budgets.reserve)))
        tiers["cpu"] = Tier("cpu", host // per_rank)
        for name in ("h2d", "d2h"):
            paths[name] = Path(name, measured.bandwidths[name].bytes_per_s)
    else:
        tiers["gpu"] = Tier("gpu", round(host // per_rank * (1 - budgets.reserve)))
    if budgets.nvme_path is not None:
        if "nvme_write" not in measured.bandwidths:
            raise ValueError(f"lazyzero.plan.nvme_path: the profile has no NVMe speeds "
                             f"({measured.skipped.get('nvme', 'not measured')})")
        tiers["nvme"] = Tier("nvme", shutil.disk_usage(budgets.nvme_path).free // per_rank)
        for name in ("nvme_read", "nvme_write"):
            paths[name] = Path(name, measured.bandwidths[name].bytes_per_s)
    # DeepSpeed's NVMe swaps of parameters and optimizer states wait for their copies; without a
    # GPU, the optimizer is always offloaded to NVMe when there is an NVMe tier (implied.py), which
    # would send a swapped layer's gradients there too; the planner's stage-3 optimizer steps them
    # from host memory instead (resident_gradients.py).
    cpu_only_nvme = "nvme" in tiers and "cpu" not in tiers
    return Machine(tiers, paths, **_optimizer_rates(profile, shape, cpu_only_nvme), nvme_swaps_block=True,
                   nvme_state_takes_grads=cpu_only_nvme, nvme_grads_resident=cpu_only_nvme)


def _optimizer_rates(profile: ModelProfile, shape: RankShape, always_offloaded: bool) -> dict:
    """Seconds per state byte: fp32 states on the device are torch's AdamW, on the host (and, with
    `always_offloaded`, everywhere) DeepSpeed's CPU Adam, or torch's AdamW where the config asks for it
    (`RankShape.torch_adam`); 8-bit states lazyzero's fused step (on the device where it was timed there)."""
    speeds = profile.machine.optimizers
    master = FP32_BYTES if shape.mixed_precision else 0

    def per_byte(name: str, moment_bytes: float) -> float:
        return speeds[name].s_per_param / (moment_bytes + master)

    eight_bit_device = "lazyzero_adamw8bit_cuda" if "lazyzero_adamw8bit_cuda" in speeds else "lazyzero_adamw8bit"
    # What DeepSpeed steps offloaded fp32 states with (`DeepSpeedEngine.get_optimizer_configuration`):
    # torch's AdamW where the config asks for it, else its CPU Adam. The calibration engines run the same
    # config, so pricing anything else there would leave the difference in DeepSpeed's per-layer cost
    # (calibrate.engine_calibrated), which then stayed in plans that step with lazyzero's 8-bit AdamW
    # (2.7 s of the `1b` run's 24 s prediction: benchmarks/results/records/2026-12-04-planner-bench-runs.md,
    # "The calibration engines' own optimizer"). On CUDA torch's AdamW was timed on the device only, so
    # the host's is priced as DeepSpeed's CPU Adam.
    torch_on_host = shape.torch_adam and "torch_adamw" in speeds and speeds["torch_adamw"].device == "cpu"
    host_fp32 = "deepspeed_cpu_adam" if "deepspeed_cpu_adam" in speeds and not torch_on_host else "torch_adamw"
    rates = {"gpu_adam_s_per_byte": per_byte(host_fp32 if always_offloaded else "torch_adamw", 8),
             "cpu_adam_s_per_byte": per_byte(host_fp32, 8)}
    if "lazyzero_adamw8bit" in speeds:
        rates["gpu_adam8_s_per_byte"] = per_byte(eight_bit_device, 2 + 8 / 256)
        rates["cpu_adam8_s_per_byte"] = per_byte("lazyzero_adamw8bit", 2 + 8 / 256)
    return rates


def uses_torch_adam(ds_config: dict) -> bool:
    """Whether DeepSpeed builds torch's Adam/AdamW for this config's optimizer section."""
    optimizer = ds_config.get("optimizer")
    if not isinstance(optimizer, dict) or str(optimizer.get("type", "")).lower() not in ("adam", "adamw"):
        return False
    return (optimizer.get("params") or {}).get("torch_adam", False) is True


def training_dtype(ds_config: dict):
    """The parameter dtype DeepSpeed trains in under this config."""
    import torch

    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        section = ds_config.get(key)
        if isinstance(section, dict) and section.get("enabled", False) is True:
            return dtype
    return torch.float32


def rank_shape(ds_config: dict, settings, world_size: int) -> RankShape:
    """One rank of a planned run with this DeepSpeed config and `plan` settings (a PlanConfig)."""
    dtype = training_dtype(ds_config)
    return RankShape(world_size, str(dtype).removeprefix("torch."), str(dtype) != "torch.float32",
                     settings.allow_8bit_optimizer, uses_torch_adam(ds_config))


def problem_for_config(profile: ModelProfile, ds_config: dict, settings, world_size: int,
                       local_ranks: int, process_bytes: int | None = None,
                       decide=lambda work: work()) -> tuple[PlanProblem, ModelSizes]:
    """The problem a planned run with this DeepSpeed config and `plan` settings (a PlanConfig) solves.
    With `plan.headroom_share`, its compute-memory capacity is placed from the problem itself
    (`calibrate.headroom_budget`), by `decide(work)`: a planned run computes it on one rank and gives
    every rank the same figure."""
    shape = rank_shape(ds_config, settings, world_size)
    budgets = Budgets(settings.cpu_mem, settings.gpu_mem, settings.nvme_path, local_ranks, settings.memory_reserve)
    problem, sizes = problem_from_profile(profile, budgets, shape, allowed_bits=tuple(settings.allowed_bits),
                                          allow_recompute=settings.allow_recompute,
                                          max_grad_error=settings.max_grad_error, process_bytes=process_bytes,
                                          feature_bytes=feature_workspace_bytes(profile, ds_config, shape))
    problem = with_int8_exchange(problem, profile, ds_config)
    problem = with_lazy_snapshot(problem, profile, ds_config, shape)
    problem = _with_checkpoint_traffic(problem, profile, ds_config, shape, settings.checkpoint_every)
    share = getattr(settings, "headroom_share", None)
    if share is None:
        return problem, sizes

    budget = decide(lambda: headroom_budget(problem, share))
    return replace(with_compute_capacity(problem, budget.capacity_bytes), headroom=budget), sizes


def _with_checkpoint_traffic(problem: PlanProblem, profile: ModelProfile, ds_config: dict, shape: RankShape,
                             every: int | None) -> PlanProblem:
    """A lazy checkpoint every `every` steps copies its snapshot while training runs: per step, its
    share of the snapshot bytes goes over the checkpoint's path (to host memory beside a GPU, else
    to NVMe, where the files are written), in windows the MILP chooses beside the other transfers.
    Without either path (no GPU, no NVMe tier) there is nothing to share: the copy is a memcpy in
    the compute memory, its buffers counted by `with_lazy_snapshot`."""
    snapshot = lazy_snapshot_bytes(profile, ds_config, shape)
    if not every or not snapshot or not (problem.machine.has_host or "nvme" in problem.machine.tiers):
        return problem
    return replace(problem, checkpoint_bytes_per_step=math.ceil(snapshot / every))


# The int8 exchange's scratch per element of a reduce bucket: packed fp32 rows, their restored fp32
# copy and the fp32 reduced row, int8 codes sent and received (lazyzero/gradients/quantized_reduce_scatter.py).
INT8_EXCHANGE_SCRATCH_BYTES_PER_ELEMENT = 3 * FP32_BYTES + 2


def feature_workspace_bytes(profile: ModelProfile, ds_config: dict, shape: RankShape) -> int:
    """Bytes the run's non-planned lazyzero features hold on every rank whatever the plan: the int8
    gradient exchange's scratch for one bucket (one layer, implied.py) and, with error feedback, its
    fp32 residuals, one per gradient element the rank sends (the whole gradient, not a partition).
    Lazy checkpoints' snapshot depends on the plan's state formats: `with_lazy_snapshot`."""
    gradients = ((ds_config.get("lazyzero") or {}).get("gradients")) or {}
    if gradients.get("enabled") is not True:
        return 0
    return INT8_EXCHANGE_SCRATCH_BYTES_PER_ELEMENT * model_sizes(profile, 1).largest_layer_numel + \
        _residual_bytes(profile, ds_config)


def with_int8_exchange(problem: PlanProblem, profile: ModelProfile, ds_config: dict) -> PlanProblem:
    """`problem` with lazyzero's int8 gradient exchange in each layer's backward in place of ZeRO-3's
    reduce-scatter (both measured by the profile, machine.py), once the engine calibration, whose
    engines reduce with ZeRO-3's own, is done; unchanged where the profile has no int8 figure."""
    gradients = ((ds_config.get("lazyzero") or {}).get("gradients")) or {}
    name = "int8_reduce_scatter_error_feedback" if gradients.get("error_feedback", False) else "int8_reduce_scatter"
    int8, fp32 = profile.machine.collectives.get(name), profile.machine.collectives.get("reduce_scatter")
    if gradients.get("enabled") is not True or int8 is None or fp32 is None:
        return problem
    rows = {row.name: row for row in profile.layers}
    extra_per_byte = int8.s_per_byte - fp32.s_per_byte
    return replace(problem, layers=tuple(
        replace(c, bwd_s=max(0.0, c.bwd_s + extra_per_byte * rows[c.name].param_numel * _DTYPE_BYTES[fp32.dtype]))
        for c in problem.layers))


def _residual_bytes(profile: ModelProfile, ds_config: dict) -> int:
    gradients = ((ds_config.get("lazyzero") or {}).get("gradients")) or {}
    if gradients.get("enabled") is not True or not gradients.get("error_feedback", False):
        return 0
    return FP32_BYTES * sum(row.param_numel for row in profile.layers)


# The files one rank's lazy checkpoint writes under ZeRO-3: its optimizer states, DeepSpeed's model
# states (rank 0's, the largest case) and lazyzero's rank state (lazyzero/checkpoint/engine_hooks.py).
CHECKPOINT_FILES_PER_RANK = 3


def _checkpoint_config(ds_config: dict):
    """The run's validated "checkpoint" section when lazy checkpoints are on, else None."""
    section = ((ds_config.get("lazyzero") or {}).get("checkpoint")) or {}
    return CheckpointConfig(**section) if section.get("enabled") is True else None


def _layer_snapshot_bytes(row: LayerProfile, shape: RankShape, eight_bit: bool) -> int:
    """What a checkpoint writes for one layer's state on a rank: ZeRO-3's fp32 partition (the master
    weights, or an fp32 model's own parameters; its 16-bit module parameters are empty there) and the
    Adam moments, 8-bit where the optimizer keeps them so."""
    numels = {name: t.numel for name, t in row.tensors.items()}
    return optimizer_state_bytes(numels, eight_bit, master_bytes=FP32_BYTES, world_size=shape.world_size)


def with_lazy_snapshot(problem: PlanProblem, profile: ModelProfile, ds_config: dict, shape: RankShape) -> PlanProblem:
    """`problem` holding lazy checkpoints' snapshot memory (problem.SnapshotMemory, in the checkpoint
    code's own terms, docs/checkpoint.md "Memory"): each layer's state bytes in either format, and
    lazyzero's rank state (the error-feedback residuals) besides."""
    from lazyzero.checkpoint.staged_io import BLOCK_BYTES

    config = _checkpoint_config(ds_config)
    if config is None:
        return problem
    rows = {row.name: row for row in profile.layers}
    layers = tuple(replace(c, snapshot_bytes_fp32=_layer_snapshot_bytes(rows[c.name], shape, False),
                           snapshot_bytes_8bit=_layer_snapshot_bytes(rows[c.name], shape, True))
                   for c in problem.layers)
    memory = SnapshotMemory(other_bytes=_residual_bytes(profile, ds_config), files=CHECKPOINT_FILES_PER_RANK,
                            block_bytes=BLOCK_BYTES, limit_bytes=config.host_buffer_limit,
                            max_in_flight=config.max_in_flight)
    return replace(problem, layers=layers, snapshot=memory)


def lazy_snapshot_bytes(profile: ModelProfile, ds_config: dict, shape: RankShape) -> int:
    """Bytes one lazy checkpoint writes on a rank, with fp32 states (the larger format; 0 without lazy
    checkpoints): the snapshot traffic `plan.checkpoint_every` spreads over the steps."""
    if _checkpoint_config(ds_config) is None:
        return 0
    return sum(_layer_snapshot_bytes(row, shape, False) for row in profile.layers) + _residual_bytes(profile, ds_config)
