"""Per-layer tiers under ZeRO-3: which parameters keep their optimizer state, and their 16-bit
partitions, on NVMe, and which in memory (docs/plan.md, "How it works", step 4).

DeepSpeed 0.19.8 has one device for all optimizer state (`offload_optimizer.device`) and one for all
parameters (`offload_param.device`). With NVMe it swaps every sub-group (a stretch of about
`sub_group_size` elements of the flat partition) that its swapper can take, and keeps the first
`max_in_cpu` parameter elements, in partition order, in host memory. `TieredZeroOptimizer_Stage3`
makes both choices per parameter name (`ZeroPlacement`):

- Sub-groups never mix tiers. Each parameter group is cut into runs of consecutive parameters with
  the same tiers, and DeepSpeed's own `sub_group_size` rule cuts each run. Whenever DeepSpeed's cut
  already falls between the runs, the sub-groups are exactly DeepSpeed's.
- A sub-group's optimizer state is swapped when its parameters are in `optimizer_nvme` and DeepSpeed's
  swapper can take it (fp32 state of at least max(1 MiB, aio.block_size)); smaller ones stay in memory
  as DeepSpeed keeps them (e.g. one layer's norm weights alone in the 8-bit optimizer's fp32 group).
  Every swap decision of the stage-3 optimizer goes through `_swappable_optimizer_subgroup`: fp32
  partition creation, step, gradient offload, checkpoint state, `nvme_restore`. So with every name on
  NVMe the run is DeepSpeed's own, and with none the optimizer state is stepped in memory like
  `offload_optimizer.device: cpu`.
- Parameters (`param_nvme`, with `offload_param.device: nvme`): the partition of a parameter is put on
  NVMe at conversion (`zero.Init._partition_param`) only if it is named, and if DeepSpeed's parameter
  swapper can take it (at least max(1 MiB, aio.block_size) of 16-bit data); the others get host
  memory. In each parameter group the sub-groups that stay in memory come first, so DeepSpeed's flat
  host buffer (sized by `max_in_cpu` otherwise) holds exactly them. DeepSpeed's grad norm is
  combined in the natural sub-group order, so the reordering does not change a bit of the clip
  factor (measured: combined in the reordered order it is one ulp off at the first step).
- A model built under `deepspeed.zero.Init` was partitioned before any plan existed, into memory
  (zero.Init without `offload_param`): the partitions of the parameters named in `param_nvme` are
  moved to NVMe before the optimizer is built, as `_partition_param` puts a partition there at
  conversion (a swap buffer, a copy, a write), through one parameter swapper that every parameter
  then shares, as those of one zero.Init do (docs/plan.md, "Planning partitioned models"). A model
  zero.Init already put on NVMe (its own `offload_param`) is refused: its swap files are in a folder
  of its own choosing, and the plan decides what goes where.
- Gradients of sub-groups swapped to NVMe are stepped from DeepSpeed's flat gradient partition in
  host memory, not written to NVMe and read back (`ResidentGradients`, resident_gradients.py).
- Checkpoints: the sub-groups' cut and tiers are part of a checkpoint's layout, as `sub_group_size`
  is for DeepSpeed; `check_checkpoint_tiers` (lazyzero/checkpoint/sub_group_tiers.py) refuses a
  restore under another placement.

Use, inside the engine: `with zero_placement(placement): super()._configure_zero_optimizer(optimizer)`.
`placement_problems` checks a placement against the ZeRO settings before anything is built.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable, Iterator, Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.swap_tensor.constants import AIO_BLOCK_SIZE
from deepspeed.runtime.swap_tensor.utils import MIN_AIO_BYTES
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils.logging import print_dist

from lazyzero.config.errors import LazyZeroConfigError, Problem
from lazyzero.patch_point import set_state, swapped
from lazyzero.plan.deepspeed.resident_gradients import ResidentGradients

OPTIMIZER_DEVICE = "zero_optimization.offload_optimizer.device"
PARAM_DEVICE = "zero_optimization.offload_param.device"
_OWNER = "lazyzero.plan (ZeRO-3 placement)"
# The state zero.Init keeps on itself and gives each parameter it converts (patch_point.py, SET).
_INIT = "deepspeed.runtime.zero.partition_parameters:Init"


@dataclass(frozen=True)
class ZeroPlacement:
    """Parameter names (as in `model.named_parameters()`) whose ZeRO-3 state goes to NVMe.

    Every other parameter's stays in memory. `param_nvme` None leaves parameter placement to
    DeepSpeed's `offload_param` settings (all or nothing, `max_in_cpu`).
    """

    optimizer_nvme: frozenset[str] = frozenset()
    param_nvme: Optional[frozenset[str]] = None

    @classmethod
    def from_modules(cls, parameter_names: Iterable[str], optimizer_nvme_modules: Iterable[str],
                     param_nvme_modules: Optional[Iterable[str]] = None) -> ZeroPlacement:
        """The placement that puts whole modules (e.g. "model.layers.3") on NVMe."""
        names = list(parameter_names)
        params = None if param_nvme_modules is None else names_under(names, param_nvme_modules)
        return cls(optimizer_nvme=names_under(names, optimizer_nvme_modules), param_nvme=params)


def names_under(parameter_names: Iterable[str], modules: Iterable[str]) -> frozenset[str]:
    """The parameter names that belong to one of `modules` (a module path, or a parameter's own name)."""
    prefixes = tuple(modules)
    return frozenset(name for name in parameter_names
                     if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes))


def placement_problems(placement: ZeroPlacement, zero_config) -> list[Problem]:
    """What in DeepSpeed's ZeRO settings (`DeepSpeedZeroConfig`) cannot realize `placement`; for a
    check before anything is built (docs/reliability.md, guarantee 6)."""
    problems = []
    if int(zero_config.stage) != 3:
        problems.append(Problem.conflict("zero_optimization.stage", int(zero_config.stage), "3",
                                         "per-layer NVMe placement subclasses the ZeRO-3 optimizer"))
    return problems + offload_problems(placement, zero_config.offload_optimizer, zero_config.offload_param)


def offload_problems(placement: ZeroPlacement, offload_optimizer, offload_param) -> list[Problem]:
    """The offload settings (DeepSpeed's offload config objects, or None) that cannot realize `placement`."""
    problems = []
    if placement.optimizer_nvme and _device(offload_optimizer) != OffloadDeviceEnum.nvme:
        problems.append(Problem.conflict(OPTIMIZER_DEVICE, _device(offload_optimizer), "'nvme'",
                                         f"the placement puts the optimizer state of {len(placement.optimizer_nvme)} "
                                         "parameters on NVMe"))
    if offload_optimizer is not None and getattr(offload_optimizer, "super_offload", False):
        problems.append(Problem.conflict("zero_optimization.offload_optimizer.super_offload", True, "false",
                                         "SuperOffload builds its own stage-3 optimizer, which ignores the placement"))
    if placement.param_nvme and _device(offload_param) != OffloadDeviceEnum.nvme:
        problems.append(Problem.conflict(PARAM_DEVICE, _device(offload_param), "'nvme'",
                                         f"the placement puts {len(placement.param_nvme)} parameters on NVMe"))
    return problems


def _device(offload_config) -> str:
    return "none" if offload_config is None else str(getattr(offload_config.device, "value", offload_config.device))


@contextmanager
def zero_placement(placement: Optional[ZeroPlacement], zero_config=None) -> Iterator[None]:
    """While active, the ZeRO-3 optimizer the engine builds is a `TieredZeroOptimizer_Stage3` for
    `placement` (None: DeepSpeed's own, unchanged).

    Raises `LazyZeroConfigError` naming the setting when the ZeRO settings cannot realize the
    placement: before anything is built if `zero_config` (`DeepSpeedZeroConfig`) is given, else when
    the stage-3 optimizer is about to be built (its offload settings) or after the block, if none
    was built (stage 1 or 2, or an engine without an optimizer, which only partitions parameters).

    The engine imports the stage-3 class from its module inside `_configure_zero_optimizer`; the
    swap (through lazyzero.patch_point) lasts only for that construction. Model parameters are
    converted to ZeRO parameters within the same construction (`DeepSpeedZeRoOffload`, when the model
    was not built under zero.Init), so this also covers parameter placement.
    """
    if placement is None:
        yield
        return
    problems = [] if zero_config is None else placement_problems(placement, zero_config)
    if problems:
        raise LazyZeroConfigError(problems)
    # Imported first: its class statement must subclass DeepSpeed's stage-3 class, not our stand-in.
    from deepspeed.runtime.superoffload import superoffload_stage3  # noqa: F401
    from deepspeed.runtime.zero import stage3

    built = []

    def build_tiered(*args, **kwargs):
        problems = offload_problems(placement, kwargs.get("offload_optimizer_config"),
                                    kwargs.get("offload_param_config"))
        if problems:
            raise LazyZeroConfigError(problems)
        built.append(TieredZeroOptimizer_Stage3(*args, placement=placement, **kwargs))
        return built[-1]

    with swapped(stage3, "DeepSpeedZeroOptimizer_Stage3", build_tiered, owner=_OWNER):
        yield
    if not built:
        raise LazyZeroConfigError([Problem("zero_optimization.stage", (
            "a ZeRO placement needs stage 3 and an optimizer; no ZeRO-3 optimizer was built, so nothing was "
            "placed (allowed: 3, with an optimizer)"))])


class TieredZeroOptimizer_Stage3(ResidentGradients, DeepSpeedZeroOptimizer_Stage3):
    """DeepSpeed's ZeRO-3 optimizer with optimizer-state and parameter tiers chosen per parameter."""

    def __init__(self, module, init_optimizer, param_names, *args, placement: ZeroPlacement, **kwargs):
        check_placement_names(placement, param_names, module)
        self.placement = placement
        self._optimizer_nvme_ids = {id(p) for p, name in param_names.items() if name in placement.optimizer_nvme}
        self._param_nvme_ids = (None if placement.param_nvme is None else
                                {id(p) for p, name in param_names.items() if name in placement.param_nvme})
        self._natural_sub_group_order = None
        if self._param_nvme_ids is not None:
            place_partitioned_parameters(module, self._param_nvme_ids, kwargs.get("offload_param_config"),
                                         kwargs.get("aio_config"))
        with _parameters_partitioned_by_placement(self._param_nvme_ids):
            super().__init__(module, init_optimizer, param_names, *args, **kwargs)
        print_dist(f"lazyzero: ZeRO-3 placement: {self.tier_report()}", ranks=[0])

    # --- sub-groups: cut between tiers; memory-resident parameters first --------------------------

    def _create_fp16_sub_groups(self, params_group):
        pieces = []
        for tiers, run in self._tier_runs(params_group):
            # (A loop, not a comprehension: zero-argument super() needs the method's own frame.)
            pieces += [(tiers, piece) for piece in super()._create_fp16_sub_groups(run)]
        if self._param_nvme_ids is not None:
            # Stable: DeepSpeed's flat host buffer per group is then exactly the in-memory prefix.
            pieces.sort(key=lambda item: item[0][1])
        return [piece for _, piece in pieces]

    def _tier_runs(self, params) -> list[tuple[tuple[bool, bool], list]]:
        runs = []
        for param in params:
            tiers = (id(param) in self._optimizer_nvme_ids, self._param_on_nvme(param))
            if runs and runs[-1][0] == tiers:
                runs[-1][1].append(param)
            else:
                runs.append((tiers, [param]))
        return runs

    def _param_on_nvme(self, param) -> bool:
        return self._param_nvme_ids is not None and id(param) in self._param_nvme_ids

    # --- optimizer state: swapped only where placed on NVMe ---------------------------------------

    def _placed_on_nvme(self, sub_group_id: int) -> bool:
        # Sub-groups never mix tiers: the first parameter speaks for all.
        return id(self.fp16_groups[sub_group_id][0]) in self._optimizer_nvme_ids

    def _swappable_optimizer_subgroup(self, sub_group_id):
        return super()._swappable_optimizer_subgroup(sub_group_id) and self._placed_on_nvme(sub_group_id)

    def _configure_tensor_swapping(self, offload_optimizer_config, aio_config):
        # DeepSpeed sizes its buffer_count swap buffers by the largest sub-group, swapped or not; a
        # large in-memory group (embeddings) would cost buffer_count copies of itself for nothing.
        every_numel = self.fp16_partitioned_groups_flat_numel
        min_numel = -(-max(MIN_AIO_BYTES, aio_config[AIO_BLOCK_SIZE]) // self._master_element_size())
        swapped = [numel for index, numel in enumerate(every_numel)
                   if self._placed_on_nvme(index) and numel >= min_numel]
        self.fp16_partitioned_groups_flat_numel = swapped or [1]
        try:
            super()._configure_tensor_swapping(offload_optimizer_config, aio_config)
        finally:
            self.fp16_partitioned_groups_flat_numel = every_numel

    def _master_element_size(self) -> int:
        return torch.tensor([], dtype=self.master_weights_and_grads_dtype).element_size()

    # --- 16-bit parameters: a flat host buffer for the in-memory ones only -------------------------

    def _create_param_groups_fp16_flat_cpu_memory(self):
        if self._param_nvme_ids is None:
            return super()._create_param_groups_fp16_flat_cpu_memory()
        for group in self.trainable_param_groups:
            numel = sum(p.partition_numel() for p in group["params"] if not self._param_on_nvme(p))
            self.param_groups_fp16_flat_cpu_memory.append(
                get_accelerator().pin_memory(torch.empty(int(numel), dtype=self.dtype)))

    def _get_norm_groups(self):
        norms = super()._get_norm_groups()
        if self._param_nvme_ids is None:
            return norms
        # combine_grad_norm_groups reduces the list in order: keep DeepSpeed's (unsorted) order.
        # With the 8-bit optimizer's fused clipping this method is replaced on the object; the patch
        # point refuses that unless clipping.py says why it is correct (`_OVER_TIERED_NORM` there).
        return [norms[index] for index in self._natural_order()]

    def _natural_order(self) -> list[int]:
        if self._natural_sub_group_order is None:
            position = {id(p): (g, k) for g, group in enumerate(self.trainable_param_groups)
                        for k, p in enumerate(group["params"])}
            self._natural_sub_group_order = sorted(range(len(self.fp16_groups)),
                                                   key=lambda index: position[id(self.fp16_groups[index][0])])
        return self._natural_sub_group_order

    # --- what the placement became ----------------------------------------------------------------

    def tier_report(self) -> dict:
        """This rank's elements per tier: optimizer state swapped / in memory, and the names placed on
        NVMe whose sub-group stayed in memory because DeepSpeed's swapper cannot take it (too small);
        with parameter tiers, 16-bit partition elements on NVMe / in memory."""
        swapped = [i for i in range(len(self.fp16_groups)) if self._swappable_optimizer_subgroup(i)]
        kept = [i for i in range(len(self.fp16_groups)) if self._placed_on_nvme(i) and i not in swapped]
        numel = self.fp16_partitioned_groups_flat_numel
        report = {"optimizer_nvme_elements": int(sum(numel[i] for i in swapped)),
                  "optimizer_memory_elements": int(sum(numel) - sum(numel[i] for i in swapped)),
                  "optimizer_nvme_too_small": sorted(self.param_names[p] for i in kept for p in self.fp16_groups[i])}
        if self._param_nvme_ids is not None:
            on_nvme = [p for group in self.fp16_groups for p in group
                       if p.ds_tensor.final_location == OffloadDeviceEnum.nvme]
            report["param_nvme_elements"] = int(sum(p.partition_numel() for p in on_nvme))
            report["param_memory_elements"] = int(sum(p.partition_numel() for g in self.fp16_groups for p in g)
                                                  - report["param_nvme_elements"])
        return report


def check_placement_names(placement: ZeroPlacement, param_names: dict, module) -> None:
    """Refuse names the model lacks (`param_names`: parameter -> name, as DeepSpeed's engine keeps
    them), and parameter tiers for a model that zero.Init put on NVMe itself."""
    known = set(param_names.values())
    unknown = sorted((placement.optimizer_nvme | (placement.param_nvme or frozenset())) - known)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise ValueError(f"ZeRO placement names parameters the model does not have: {shown}")
    if placement.param_nvme is not None and any(_partition_on_nvme(p) for p in module.parameters()):
        raise ValueError("a ZeRO placement with param_nvme needs a model whose parameters are in memory: "
                         "deepspeed.zero.Init put some on NVMe (offload_param device 'nvme' in the config or "
                         "remote_device given to zero.Init); build it under zero.Init without offload_param, "
                         "and the placement puts the planned layers on NVMe")


def _partition_on_nvme(param) -> bool:
    partition = getattr(param, "ds_tensor", None)
    return partition is not None and getattr(partition, "final_location", None) == OffloadDeviceEnum.nvme


def place_partitioned_parameters(module, nvme_ids: set[int], offload_param_config, aio_config) -> None:
    """Move the in-memory partitions of `module`'s already partitioned parameters whose ids are in
    `nvme_ids` to NVMe, as zero.Init does at conversion (module docstring); those too small for the
    swapper stay in memory, as there. Every partitioned parameter gets the swapper (DeepSpeed's
    stage-3 optimizer reaches it through the first parameter of the first sub-group)."""
    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id") and p.ds_tensor is not None]
    if not partitioned or _device(offload_param_config) != OffloadDeviceEnum.nvme:
        return
    swapper = _parameter_swapper(partitioned[0].dtype, offload_param_config, aio_config)
    for param in partitioned:
        set_state(param, "nvme_swapper", swapper, owner=_OWNER, holder=_INIT)
        if id(param) in nvme_ids and swapper.swappable_tensor(param=param):
            _partition_to_nvme(param, swapper)


def _parameter_swapper(dtype: torch.dtype, offload_param_config, aio_config):
    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    # The swapper reads these two fields of a DeepSpeedConfig, and nothing else.
    config = SimpleNamespace(zero_config=SimpleNamespace(offload_param=offload_param_config), aio_config=aio_config)
    return AsyncPartitionedParameterSwapper(config, dtype)


def _partition_to_nvme(param, swapper) -> None:
    """`zero.Init._partition_param`'s first-time NVMe branch, for a partition that exists already."""
    partition = param.ds_tensor
    buffer = swapper.get_buffer(param, partition.ds_numel)
    buffer.copy_(partition.data)
    partition.data = buffer.data
    set_state(partition, "final_location", OffloadDeviceEnum.nvme, owner=_OWNER, holder=_INIT)
    swapper.swap_out_and_release([param])


@contextmanager
def _parameters_partitioned_by_placement(nvme_ids: Optional[set[int]]) -> Iterator[None]:
    """While active, a parameter partitioned for the first time under NVMe parameter offload goes to
    NVMe only if its id is in `nvme_ids`; the others get host memory, as DeepSpeed gives those too
    small to swap. `zero.Init._partition_param` decides this from its `remote_device` alone."""
    if nvme_ids is None:
        yield
        return
    original = Init._partition_param

    def partition_param(init, param, *args, **kwargs):
        first_time = getattr(param, "ds_tensor", None) is None
        if not first_time or init.remote_device != OffloadDeviceEnum.nvme or id(param) in nvme_ids:
            return original(init, param, *args, **kwargs)
        remote_device = init.remote_device
        set_state(init, "remote_device", OffloadDeviceEnum.cpu, owner=_OWNER)
        try:
            return original(init, param, *args, **kwargs)
        finally:
            set_state(init, "remote_device", remote_device, owner=_OWNER)

    with swapped(Init, "_partition_param", partition_param, owner=_OWNER):
        yield
