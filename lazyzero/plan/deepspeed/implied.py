"""The DeepSpeed config, "lazyzero" section and per-layer placement a plan implies.

A plan speaks of tiers ("gpu": the memory training computes in, which on a machine without a GPU is
host memory under the budget; "cpu": host memory beside a GPU; "nvme"). DeepSpeed 0.19.8 offers one
offload device for all parameters and one for all optimizer state, so, for each of the two:
- when any layer's tensors are on NVMe, the device is "nvme" and the per-layer choice goes into
  `ImpliedSetup.param_nvme_layers` / `optimizer_nvme_layers`: a planned run places only those layers
  on NVMe (`lazyzero/plan/deepspeed/zero_placement.py`), the others stay in host memory;
- host memory next to a GPU is "cpu"; a plan keeping some of them on the GPU and others off it is
  refused (`PlanNotExpressible`): DeepSpeed offloads all of a kind or none.
- activations: per-layer widths, recomputed layers and offloaded layers in the activations section.
- the ZeRO-3 knobs that decide transient memory follow the model's sizes when they are given
  (`ModelSizes`): gathered parameters are released after each use and at most two layers are live,
  as the planner's windows assume.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass

from lazyzero.activations.config import ActivationsConfig
from lazyzero.config.optimizer_swap import PARTITIONED_BUFFER_COUNT
from lazyzero.plan.deepspeed.costs import decoder_layer_index
from lazyzero.plan.solver.problem import Plan, PlanProblem

DEFAULT_BASE_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True}}
_ACTIVATION_DEFAULTS = ActivationsConfig()
# DeepSpeed's NVMe parameter swapper needs buffers for every tensor of the layers in flight; the
# notes (docs/deepspeed-internals.md) found about one per tensor of a layer too few.
PARAM_SWAP_BUFFERS_PER_TENSOR = 2
# Buffers of DeepSpeed's NVMe optimizer swapper, each one fp32 partition of the largest swapped
# sub-group (its default; the planner counts them as the swapper's staging memory).
OPTIMIZER_SWAP_BUFFERS = PARTITIONED_BUFFER_COUNT


class PlanNotExpressible(ValueError):
    """The plan places tensors in a way DeepSpeed's offload settings cannot express."""


@dataclass(frozen=True)
class ModelSizes:
    """Element counts the ZeRO-3 settings are sized from (whole tensors, not partitions)."""

    largest_layer_numel: int
    largest_tensor_numel: int
    tensors_per_layer: int
    world_size: int


@dataclass(frozen=True)
class ImpliedSetup:
    ds_config: dict
    optimizer_nvme_layers: tuple[str, ...]
    """Names of the problem's layers whose optimizer state is swapped to NVMe (the others stay in
    host memory); empty when `offload_optimizer` is not NVMe."""
    param_nvme_layers: tuple[str, ...] = ()
    """The same for the 16-bit parameters (`offload_param`)."""


def implied_setup(problem: PlanProblem, plan: Plan, base: dict | None = None, *, nvme_path: str | None = None,
                  sizes: ModelSizes | None = None) -> ImpliedSetup:
    """`base` (default: a bf16 micro-batch-1 config) with the ZeRO-3 settings and "lazyzero"
    sections this plan implies. `nvme_path` is required when the plan uses NVMe."""
    config = copy.deepcopy(DEFAULT_BASE_CONFIG if base is None else base)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = 3
    param_layers = _set_parameter_offload(zero, problem, plan, nvme_path, sizes)
    state_layers = _set_optimizer_offload(zero, problem, plan, nvme_path)
    if sizes is not None:
        zero.update(_transient_memory_settings(sizes, bool(param_layers)))
    section = config.setdefault("lazyzero", {})
    # The user's own activation settings stay; what an earlier plan set for its layers (a re-plan's
    # base is the running plan's config) does not: its offloaded layers may be this plan's recomputed ones.
    users = {name: value for name, value in section.get("activations", {}).items()
             if name not in ActivationsConfig.planned_fields}
    activations = _activations_section(problem, plan, nvme_path)
    if activations is not None:
        section["activations"] = {**users, **activations}
    elif "activations" in section:
        section["activations"] = users
    if any(lp.state_8bit for lp in plan.layers):
        base_type = str(config.get("optimizer", {}).get("type", "adamw")).lower()
        section["optimizer"] = {**section.get("optimizer", {}), "enabled": True,
                                "type": "adam8bit" if base_type == "adam" else "adamw8bit",
                                "fraction_8bit": eight_bit_share(problem, plan)}
    return ImpliedSetup(config, state_layers, param_layers)


def implied_ds_config(problem: PlanProblem, plan: Plan, base: dict | None = None, *,
                      nvme_path: str | None = None) -> dict:
    """The DeepSpeed config of `implied_setup` (for `lazyzero plan`'s ds_config.json)."""
    return implied_setup(problem, plan, base, nvme_path=nvme_path).ds_config


def _offload_section(tier: str, nvme_path: str | None, what: str) -> dict:
    if tier == "gpu":
        return {"device": "none"}
    if tier == "cpu":
        return {"device": "cpu", "pin_memory": True}
    if nvme_path is None:
        raise ValueError(f"the plan puts {what} on NVMe: the implied config needs nvme_path")
    return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False}


def _offload(problem: PlanProblem, tiers: list[str], what: str, nvme_path: str | None) -> tuple[dict, tuple[str, ...]]:
    """DeepSpeed's offload section for `what` with these per-layer tiers, and the layers on NVMe.

    With any layer on NVMe the section is NVMe and the layers are listed (lazyzero places each
    layer's tensors, zero_placement.py; the others stay in host memory). Next to a GPU, tensors on
    the device and tensors off it cannot be mixed: DeepSpeed offloads all of a kind or none."""
    used = set(tiers)
    if problem.machine.has_host and "gpu" in used and len(used) > 1:
        where = {tier: [c.name for c, t in zip(problem.layers, tiers) if t == tier] for tier in sorted(used)}
        raise PlanNotExpressible(f"the plan keeps some {what} on the GPU and the rest off it ({where}); DeepSpeed "
                                 "offloads all of them or none")
    if "nvme" in used:
        nvme_layers = tuple(c.name for c, t in zip(problem.layers, tiers) if t == "nvme")
        return _offload_section("nvme", nvme_path, what), nvme_layers
    return _offload_section("cpu" if "cpu" in used else "gpu", nvme_path, what), ()


def _set_parameter_offload(zero: dict, problem: PlanProblem, plan: Plan, nvme_path: str | None,
                           sizes: ModelSizes | None) -> tuple[str, ...]:
    section, nvme_layers = _offload(problem, [lp.param_tier for lp in plan.layers], "parameters", nvme_path)
    zero["offload_param"] = _nvme_param_section(section, sizes) if section["device"] == "nvme" else section
    return nvme_layers


def _nvme_param_section(section: dict, sizes: ModelSizes | None) -> dict:
    """`section` (offload_param to NVMe) with nothing kept in host memory by DeepSpeed (lazyzero places
    each layer) and, given the sizes, swap buffers for every tensor of the layers in flight."""
    section = {**section, "max_in_cpu": 0}
    if sizes is not None:
        section.update(buffer_size=_partition(sizes.largest_tensor_numel, sizes.world_size),
                       buffer_count=PARAM_SWAP_BUFFERS_PER_TENSOR * sizes.tensors_per_layer)
    return section


def _set_optimizer_offload(zero: dict, problem: PlanProblem, plan: Plan, nvme_path: str | None) -> tuple[str, ...]:
    """On a machine without a GPU whose problem has an NVMe tier, the optimizer is offloaded to NVMe
    whatever the plan (the problem says so: `Machine.nvme_state_takes_grads`), with only the plan's
    NVMe layers swapped: DeepSpeed's CPU optimizer then steps every partition, fastest on a CPU."""
    section, nvme_layers = _offload(problem, [lp.state_tier for lp in plan.layers], "optimizer states", nvme_path)
    if problem.machine.nvme_state_takes_grads and section["device"] == "none":
        section = _offload_section("nvme", nvme_path, "optimizer states")
    if section["device"] == "nvme":
        section["buffer_count"] = OPTIMIZER_SWAP_BUFFERS
    zero["offload_optimizer"] = section
    return nvme_layers


def calibration_ds_config(base: dict, sizes: ModelSizes, nvme_path: str | None, offload_to_nvme: bool) -> dict:
    """The DeepSpeed config the profile's engine calibration runs (plan/profile/engine_calibration.py): the run's own
    ZeRO-3 settings with every tensor in memory, and no "lazyzero" section."""
    config = copy.deepcopy(base)
    config.pop("lazyzero", None)
    zero = config.setdefault("zero_optimization", {})
    zero.update(stage=3, offload_param={"device": "none"}, **_transient_memory_settings(sizes, False))
    zero["offload_optimizer"] = ({**_offload_section("nvme", nvme_path, "optimizer states"),
                                  "buffer_count": OPTIMIZER_SWAP_BUFFERS} if offload_to_nvme else {"device": "none"})
    return config


def nvme_calibration_ds_config(calibration: dict, sizes: ModelSizes, nvme_path: str, parameters: bool) -> dict:
    """The engine calibration's config (`calibration_ds_config` with its optimizer offloaded to NVMe)
    swapping in the folder `nvme_path`, with the parameters offloaded there too where `parameters`,
    set as a plan that puts parameters on NVMe sets them: the config of the calibration engine whose
    decoder layers are swapped (engine_calibration.py)."""
    config = copy.deepcopy(calibration)
    zero = config["zero_optimization"]
    zero["offload_optimizer"] = {**zero["offload_optimizer"], "nvme_path": nvme_path}
    if parameters:
        zero["offload_param"] = _nvme_param_section(_offload_section("nvme", nvme_path, "parameters"), sizes)
        zero.update(_transient_memory_settings(sizes, True))
    return config


def _partition(numel: int, world_size: int) -> int:
    return -(-numel // world_size)


def _transient_memory_settings(sizes: ModelSizes, params_on_nvme: bool) -> dict:
    """Gathered parameters are released after each use (the planner gathers them again for the
    backward) and no more than two layers' worth live at once; one layer's gradients fill a bucket;
    one layer's partition per optimizer sub-group. DeepSpeed's NVMe parameter prefetch fails in 0.19.8
    ("param already assigned swap buffer", docs/deepspeed-internals.md), so it is off with parameters on NVMe."""
    layer = sizes.largest_layer_numel
    return {"stage3_max_live_parameters": 2 * layer, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0 if params_on_nvme else layer,
            "reduce_bucket_size": layer, "sub_group_size": _partition(layer, sizes.world_size)}


def _width_overrides(layer: int, bits: int, default_bits: int) -> dict[str, int]:
    """Overrides giving decoder layer `layer` the analytic model's widths when they differ from the
    default. An override outranks attention_bits and norm_bits (lazyzero/activations/policy.py), so
    a quantized layer names its MLP and norms only, keeping attention at 16 bits and norms at
    norm_bits or more, as the costs assume."""
    if bits == default_bits:
        return {}
    if bits == 16:
        return {f"model.layers.{layer}.*": 16}
    return {f"model.layers.{layer}.mlp": bits,
            f"model.layers.{layer}.*layernorm": max(bits, _ACTIVATION_DEFAULTS.norm_bits)}


def _activations_section(problem: PlanProblem, plan: Plan, nvme_path: str | None) -> dict | None:
    """Recomputed, offloaded and per-layer widths of the decoder layers; None when the plan keeps
    every activation at 16 bits on the device (the feature would only add hooks)."""
    recompute, kept, offload = [], {}, {}
    for costs, lp in zip(problem.layers, plan.layers):
        layer = decoder_layer_index(costs.name)
        if layer is None:
            continue
        if lp.act_mode == "recompute":
            recompute.append(layer)
            continue
        kept[layer] = lp.act_bits
        if lp.offloaded:
            offload[str(layer)] = lp.act_tier
    if not recompute and not offload and all(bits == 16 for bits in kept.values()):
        return None
    # The most common width becomes the default, so that the overrides name only the exceptions.
    default_bits = Counter(kept.values()).most_common(1)[0][0] if kept else 16
    overrides = {}
    for layer, bits in kept.items():
        overrides.update(_width_overrides(layer, bits, default_bits))
    section = {"enabled": True, "default_bits": default_bits, "recompute_layers": recompute, "overrides": overrides}
    if offload:
        if "nvme" in offload.values() and nvme_path is None:
            raise ValueError("the plan offloads activations to NVMe: the implied config needs nvme_path")
        section["offload_layers"] = offload
        if nvme_path is not None and "nvme" in offload.values():
            section["offload_nvme_path"] = nvme_path
    return section


def eight_bit_share(problem: PlanProblem, plan: Plan) -> float:
    """Share of the possible 8-bit state saving the plan takes. Every eligible element saves the same
    bytes, so this is the share of eligible elements, i.e. OptimizerConfig.fraction_8bit. The runtime
    picks the largest tensors first rather than these layers: same total, different tensors."""
    savings = [c.optim_state_bytes_fp32 - c.optim_state_bytes_8bit for c in problem.layers]
    taken = sum(s for s, lp in zip(savings, plan.layers) if lp.state_8bit)
    return round(taken / sum(savings), 4) if sum(savings) > 0 else 0.0
