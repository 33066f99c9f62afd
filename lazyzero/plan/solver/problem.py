"""The memory planner's problem and its answer (docs/plan.md).

A training step is cut into 2L + 1 windows: the forward of layers 0..L-1 (windows 0..L-1), the
backward of layers L-1..0 (windows L..2L-1), and one optimizer window (2L). Each window lasts as long
as its compute; copies run beside the compute on the machine's paths (d2h, h2d, nvme_write,
nvme_read), and a window is stretched when a path needs longer than the compute ("exposed" time).

Per layer a plan chooses how its saved activations survive until backward (kept at 16/8/4 bits on a
tier, or recomputed from the layer's input), where its 16-bit parameters and its optimizer state live,
and whether that state is 8-bit. This module holds the problem, the plan, and the rules both the MILP
(`milp.py`) and the step simulator (`simulate.py`) share: which windows data may move in, which paths
a copy takes, what the optimizer costs. Memory accounting is deliberately NOT shared: the simulator
walks the windows on its own so that it can catch errors in the MILP's capacity formulas.

Simplifications, all deliberate (LazyTrain-style planning, not a hardware model):
- Compute and every path run in parallel; one copy's two hops (d2h then nvme_write) share a window.
- A non-GPU parameter is fetched in the window before each use (forward and backward of its layer;
  for layer 0's forward that is the previous step's optimizer window: the step repeats).
- Host bounce buffers for NVMe copies are not counted.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

TIER_NAMES = ("gpu", "cpu", "nvme")
PATH_NAMES = ("d2h", "h2d", "nvme_write", "nvme_read")
BIT_WIDTHS = (16, 8, 4)
REDUCED_WIDTHS = (8, 4)  # the widths that lose precision (16 keeps activations as saved)
PLAN_SOURCES = ("milp", "greedy", "fixed_rule", "deepspeed_default")


class PlanInfeasible(ValueError):
    """No plan fits the budgets; `tiers` names the binding one(s)."""

    def __init__(self, message: str, tiers: tuple[str, ...]):
        super().__init__(message)
        self.tiers = tuple(tiers)


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field_name}: {message}")


def _require_nonnegative(owner: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(owner, name)
        _require(isinstance(value, (int, float)) and value >= 0, name, f"must be a number >= 0, got {value!r}")


def _require_one_of(owner: object, names: tuple[str, ...], allowed: tuple) -> None:
    for name in names:
        value = getattr(owner, name)
        _require(value in allowed, name, f"got {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class LayerCosts:
    """What one layer costs: compute seconds on the device, and bytes.

    act_bytes[bits]: activations the layer saves for backward when stored at that width.
    input_bytes: what a recomputed layer keeps instead (its input).
    optim_state_bytes_fp32 / _8bit: whatever the caller counts (moments, master weights).
    quality_cost[bits]: penalty per step, in seconds-equivalent, for storing at that width (16 -> 0).
    pack_fwd_s[bits] / pack_bwd_s[bits]: seconds that storing at that width adds to the layer's
    forward (quantizing) and backward (restoring); 0 for 16 bits unless measured otherwise.
    recompute_s: seconds a recompute adds to the backward (None: the forward's fwd_s).
    offload_fwd_s[bits] / offload_bwd_s[bits]: seconds that moving the stored activations off the
    device at that width costs the forward / backward besides the copies' own time on their paths
    (the work of moving them: on a machine without a GPU it competes with compute).
    stage_bytes_fp32 / _8bit: host bytes the NVMe optimizer swapper stages to step this layer's state
    (None: the state's own bytes).
    engine_excess_bytes: what DeepSpeed and the allocator hold for this layer beyond the formulas
    while its parameters and optimizer state are in compute memory (measured per layer on
    all-in-memory engines, calibrate.engine_calibrated); see `engine_excess_held`.
    snapshot_bytes_fp32 / _8bit: bytes a lazy checkpoint writes for this layer's state (its fp32
    partition and moments; 0 without lazy checkpoints), see `SnapshotMemory`.
    act_widths: the widths this layer may store its activations at; a width whose measured gradient
    error exceeds the run's bound (`plan.max_grad_error`, plan/deepspeed/problem_from_profile.py) is left out. 16
    (exact) always stays, and recompute is always possible, so the bound never takes away a plan.
    grad_error[bits]: that measured error (LayerProfile.grad_error), shown beside the plan; None where
    nothing was measured (the analytic presets).
    """

    name: str
    fwd_s: float
    bwd_s: float
    act_bytes: dict[int, int]
    input_bytes: int
    param_bytes: int
    grad_bytes: int
    optim_state_bytes_fp32: int
    optim_state_bytes_8bit: int
    quality_cost: dict[int, float]
    pack_fwd_s: dict[int, float] = field(default_factory=lambda: dict.fromkeys(BIT_WIDTHS, 0.0))
    pack_bwd_s: dict[int, float] = field(default_factory=lambda: dict.fromkeys(BIT_WIDTHS, 0.0))
    recompute_s: float | None = None
    offload_fwd_s: dict[int, float] = field(default_factory=lambda: dict.fromkeys(BIT_WIDTHS, 0.0))
    offload_bwd_s: dict[int, float] = field(default_factory=lambda: dict.fromkeys(BIT_WIDTHS, 0.0))
    stage_bytes_fp32: int | None = None
    stage_bytes_8bit: int | None = None
    snapshot_bytes_fp32: int = 0
    snapshot_bytes_8bit: int = 0
    engine_excess_bytes: int = 0
    act_widths: tuple[int, ...] = BIT_WIDTHS
    grad_error: dict[int, float] | None = None

    def engine_excess_held(self, param_tier: str, state_tier: str) -> int:
        """Bytes of `engine_excess_bytes` this layer holds under that placement: all of it only where
        its parameters and optimizer state both stay in compute memory, as on the calibration engines.
        A layer with either on another tier held none of it in every run measured (the `1b` preset's
        layers with parameters in memory and states on NVMe,
        benchmarks/results/records/2026-12-04-planner-1b-runs.md)."""
        return self.engine_excess_bytes if param_tier == state_tier == "gpu" else 0

    def __post_init__(self):
        _require(bool(self.name), "name", "must be a non-empty string")
        object.__setattr__(self, "act_widths", tuple(self.act_widths))
        _require(16 in self.act_widths and set(self.act_widths) <= set(BIT_WIDTHS), "act_widths",
                 f"must hold 16 (exact storage is always allowed) and only widths of {BIT_WIDTHS}, "
                 f"got {self.act_widths!r}")
        _require_nonnegative(self, ("fwd_s", "bwd_s", "input_bytes", "param_bytes", "grad_bytes",
                                    "engine_excess_bytes", "optim_state_bytes_fp32", "optim_state_bytes_8bit"))
        _require(self.recompute_s is None or self.recompute_s >= 0, "recompute_s",
                 f"must be None or a number >= 0, got {self.recompute_s!r}")
        for field_name in ("act_bytes", "quality_cost", "pack_fwd_s", "pack_bwd_s", "offload_fwd_s", "offload_bwd_s"):
            table = getattr(self, field_name)
            _require(set(table) == set(BIT_WIDTHS), field_name, f"needs exactly the keys {BIT_WIDTHS}")
            _require(all(v >= 0 for v in table.values()), field_name, "values must be >= 0")
        if self.grad_error is not None:
            _require(set(self.grad_error) == set(BIT_WIDTHS) and all(v >= 0 for v in self.grad_error.values()),
                     "grad_error", f"needs exactly the keys {BIT_WIDTHS}, with values >= 0 (or None)")
        _require(self.quality_cost[16] == 0, "quality_cost", "16 bits is the reference: its cost must be 0")

    def state_bytes(self, eight_bit: bool) -> int:
        return self.optim_state_bytes_8bit if eight_bit else self.optim_state_bytes_fp32

    def snapshot_bytes(self, eight_bit: bool) -> int:
        return self.snapshot_bytes_8bit if eight_bit else self.snapshot_bytes_fp32

    def stage_bytes(self, eight_bit: bool) -> int:
        staged = self.stage_bytes_8bit if eight_bit else self.stage_bytes_fp32
        return self.state_bytes(eight_bit) if staged is None else staged

    @property
    def recompute_seconds(self) -> float:
        return self.fwd_s if self.recompute_s is None else self.recompute_s

    def window_seconds(self, act: ActChoice) -> tuple[float, float]:
        """(forward, backward) seconds of this layer with activation choice `act`: compute, packing,
        the work of offloading, or the recompute."""
        if act.mode == "recompute":
            return self.fwd_s, self.bwd_s + self.recompute_seconds
        offloaded = act.tier != "gpu"
        return (self.fwd_s + self.pack_fwd_s[act.bits] + (self.offload_fwd_s[act.bits] if offloaded else 0.0),
                self.bwd_s + self.pack_bwd_s[act.bits] + (self.offload_bwd_s[act.bits] if offloaded else 0.0))


@dataclass(frozen=True)
class Tier:
    name: str
    capacity_bytes: int

    def __post_init__(self):
        _require_one_of(self, ("name",), TIER_NAMES)
        _require_nonnegative(self, ("capacity_bytes",))


@dataclass(frozen=True)
class Path:
    name: str
    bytes_per_s: float

    def __post_init__(self):
        _require_one_of(self, ("name",), PATH_NAMES)
        _require(self.bytes_per_s > 0, "bytes_per_s", f"must be > 0, got {self.bytes_per_s!r}")


@dataclass(frozen=True)
class Machine:
    """Memory tiers, copy paths and optimizer speeds.

    "gpu" is always the compute memory. A CPU-only machine is {"gpu" (host memory under the training
    budget), "nvme"}: then NVMe copies go straight to and from the compute memory, the optimizer runs
    there, and there are no d2h/h2d paths.

    Optimizer seconds per byte of state: `gpu_*` for states on the compute memory, `cpu_*` for
    offloaded states (DeepSpeed steps them with its CPU optimizer, also on a CPU-only machine where
    an NVMe-offloaded state is stepped in host memory); `*_adam8_*` for 8-bit states (None: the fp32
    rate).
    """

    tiers: dict[str, Tier]
    paths: dict[str, Path]
    cpu_adam_s_per_byte: float
    gpu_adam_s_per_byte: float
    cpu_adam8_s_per_byte: float | None = None
    gpu_adam8_s_per_byte: float | None = None
    nvme_swaps_block: bool = False
    """DeepSpeed's NVMe swaps of parameters and optimizer state wait for their reads and writes (its
    parameter prefetch is off, docs/deepspeed-internals.md; lazyzero's 8-bit states use the non-pipelined
    swapper): their seconds add to the window's time instead of overlapping its compute."""
    nvme_state_takes_grads: bool = False
    """Without a host tier, a layer whose optimizer state is on NVMe has its gradients written there
    after its backward and read back for the step (DeepSpeed's NVMe optimizer swapper)."""
    nvme_grads_resident: bool = False
    """With `nvme_state_takes_grads`: the step of such a layer reads its gradients from DeepSpeed's flat
    gradient partition in host memory instead (the planner's stage-3 optimizer,
    lazyzero/plan/deepspeed/resident_gradients.py), so they cost no NVMe copies; their memory is as above."""
    nvme_param_bytes_per_s: float | None = None
    """The speed of parameters' blocking NVMe copies where it differs from the paths' (None: the
    paths'). DeepSpeed reads a layer's parameters one tensor at a time before its use, and writes them
    back after the step; optimizer states move in large pipelined blocks. The profile measures both
    (calibrate.nvme_calibrated)."""

    def __post_init__(self):
        _require("gpu" in self.tiers, "tiers", "needs a 'gpu' tier (the compute memory)")
        for key, tier in self.tiers.items():
            _require(key == tier.name, "tiers", f"key {key!r} holds the tier named {tier.name!r}")
        for key, path in self.paths.items():
            _require(key == path.name, "paths", f"key {key!r} holds the path named {path.name!r}")
        needed = set()
        for tier in self.tiers:
            if tier != "gpu":
                needed.update(self.route_down(tier) + self.route_up(tier))
        missing = sorted(needed - set(self.paths))
        _require(not missing, "paths", f"the tiers {sorted(self.tiers)} need the paths {missing}")
        _require_nonnegative(self, ("cpu_adam_s_per_byte", "gpu_adam_s_per_byte"))
        for name in ("cpu_adam8_s_per_byte", "gpu_adam8_s_per_byte"):
            _require(getattr(self, name) is None or getattr(self, name) >= 0, name, "must be None or a number >= 0")
        _require(self.nvme_param_bytes_per_s is None or self.nvme_param_bytes_per_s > 0, "nvme_param_bytes_per_s",
                 f"must be None or a number > 0, got {self.nvme_param_bytes_per_s!r}")

    @property
    def has_host(self) -> bool:
        return "cpu" in self.tiers

    def tier_label(self, tier: str) -> str:
        """What tables, plots and messages call `tier`: without a separate host tier the memory training
        computes in is host memory (a machine without a GPU), and "gpu" would read as a mistake there."""
        return "host" if tier == "gpu" and not self.has_host else tier

    def route_down(self, tier: str) -> tuple[str, ...]:
        """Paths a copy from the compute memory to `tier` loads (NVMe goes through host memory)."""
        if tier == "cpu":
            return ("d2h",)
        return ("d2h", "nvme_write") if self.has_host else ("nvme_write",)

    def route_up(self, tier: str) -> tuple[str, ...]:
        if tier == "cpu":
            return ("h2d",)
        return ("nvme_read", "h2d") if self.has_host else ("nvme_read",)

    def optimizer_on_host(self, state_tier: str) -> bool:
        """Optimizer state off the device is stepped by the CPU (ZeRO-Offload), if there is a host."""
        return state_tier != "gpu" and self.has_host

    def grads_leave_device(self, state_tier: str) -> bool:
        """Whether a layer's gradients leave the compute memory after its backward: to the host for a
        host optimizer, or to NVMe with the state (`nvme_state_takes_grads`)."""
        return self.optimizer_on_host(state_tier) or (self.nvme_state_takes_grads and state_tier == "nvme")

    def adam_s_per_byte(self, state_tier: str, eight_bit: bool) -> float:
        offloaded = state_tier != "gpu"
        rate = (self.cpu_adam8_s_per_byte if offloaded else self.gpu_adam8_s_per_byte) if eight_bit else None
        if rate is not None:
            return rate
        return self.cpu_adam_s_per_byte if offloaded else self.gpu_adam_s_per_byte


@dataclass(frozen=True)
class SnapshotMemory:
    """What a lazy checkpoint's snapshot holds in host memory from the first save on, in the terms of
    the checkpoint code (`lazyzero.checkpoint.snapshot.snapshot_host_bytes`): the bytes each layer's
    state writes (`LayerCosts.snapshot_bytes`), copied into a host buffer first where the state is
    on the device beside a host, or on NVMe (swap files); `other_bytes` written besides the layers
    (lazyzero's rank state); `files` per rank; the settings of the "checkpoint" section."""

    other_bytes: int
    files: int
    block_bytes: int
    limit_bytes: int | None = None
    max_in_flight: int = 1


@dataclass(frozen=True)
class PlanProblem:
    layers: tuple[LayerCosts, ...]
    machine: Machine
    workspace_bytes: int
    checkpoint_bytes_per_step: int = 0
    allowed_bits: tuple[int, ...] = BIT_WIDTHS
    allow_recompute: bool = True
    allow_8bit_optimizer: bool = True
    # DeepSpeed offloads all parameters (all optimizer states) of a model or none: with this rule each
    # kind is either on the compute device in every layer or off it in every layer; which off-device
    # tier is each layer's choice (lazyzero places NVMe per layer, lazyzero/plan/deepspeed/zero_placement.py).
    # Set where there is a host tier beside the device; without one, "off the device" is NVMe alone.
    offload_all_or_none: bool = False
    # Tiers parameters may live on (None: every tier), e.g. not NVMe for an fp32 model on a machine
    # without a GPU, where DeepSpeed 0.19.8's NVMe parameter swapper fails (docs/deepspeed-internals.md).
    param_tiers: tuple[str, ...] | None = None
    # Per layer, the Placement (param tier, state tier, 8-bit) a running engine cannot change any
    # more, or None where the planner is free; re-planning fixes all of them (plan/deepspeed/calibrate.py).
    fixed_placements: tuple | None = None
    # Per layer, the activation width a re-plan keeps, or None where the planner is free: a layer
    # packed at 8 or 4 bits keeps that width, one at 16 bits or recomputed stays exact (16 bits or
    # recompute), so that a re-plan moves tensors without changing what training computes and a
    # resumed run repeats the uninterrupted one's losses (plan/deepspeed/calibrate.py).
    fixed_act_bits: tuple | None = None
    # Bytes held whenever any layer's parameters are on NVMe (DeepSpeed's parameter swapper: its
    # buffer pool and partitioned swap buffer, plan/deepspeed/swap_buffers.py), in host memory: the "cpu" tier where
    # there is one, else the compute memory.
    param_swap_bytes: int = 0
    # How the compute-memory capacity was placed when the user gave `plan.headroom_share`
    # (calibrate.HeadroomBudget: the share, the least capacity with a plan, the all-in-memory peak).
    headroom: object | None = None
    # Lazy checkpoints' snapshot memory (None: no lazy checkpoints), held on `host_tier()` from the
    # first save on, so that the predicted peak is the one after the first checkpoint.
    snapshot: SnapshotMemory | None = None

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "allowed_bits", tuple(self.allowed_bits))
        _require(len(self.layers) > 0, "layers", "needs at least one layer")
        names = [layer.name for layer in self.layers]
        _require(len(set(names)) == len(names), "layers", "layer names must be unique")
        _require_nonnegative(self, ("workspace_bytes", "checkpoint_bytes_per_step", "param_swap_bytes"))
        _require(bool(self.allowed_bits) and set(self.allowed_bits) <= set(BIT_WIDTHS), "allowed_bits",
                 f"must be a non-empty subset of {BIT_WIDTHS}, got {self.allowed_bits!r}")
        if self.param_tiers is not None:
            object.__setattr__(self, "param_tiers", tuple(self.param_tiers))
            _require(bool(self.param_tiers) and set(self.param_tiers) <= set(self.machine.tiers), "param_tiers",
                     f"must be a non-empty subset of the machine's tiers {sorted(self.machine.tiers)}, "
                     f"got {self.param_tiers!r}")
        if self.fixed_placements is not None:
            object.__setattr__(self, "fixed_placements", tuple(self.fixed_placements))
            _require(len(self.fixed_placements) == len(self.layers), "fixed_placements",
                     f"needs one entry (a placement or None) per layer, got {len(self.fixed_placements)}")
        if self.fixed_act_bits is not None:
            object.__setattr__(self, "fixed_act_bits", tuple(self.fixed_act_bits))
            _require(len(self.fixed_act_bits) == len(self.layers), "fixed_act_bits",
                     f"needs one entry (a width or None) per layer, got {len(self.fixed_act_bits)}")
        for i, costs in enumerate(self.layers):
            _require(bool(self.layer_widths(i)) or self.may_recompute(i), "allowed_bits",
                     f"layer {costs.name} may store its activations at {costs.act_widths} (its gradient error "
                     f"bound), none of which is in {self.allowed_bits}, and recompute is not allowed")

    def layer_widths(self, layer: int) -> tuple[int, ...]:
        """The widths layer `layer` may store its activations at: allowed for the run and for the layer,
        only the fixed one where `fixed_act_bits` names it."""
        fixed = None if self.fixed_act_bits is None else self.fixed_act_bits[layer]
        if fixed is not None:
            return (fixed,)
        return tuple(bits for bits in self.allowed_bits if bits in self.layers[layer].act_widths)

    def may_recompute(self, layer: int) -> bool:
        """Whether layer `layer` may be recomputed: allowed, and exact where its width is fixed."""
        fixed = None if self.fixed_act_bits is None else self.fixed_act_bits[layer]
        return self.allow_recompute and fixed in (None, 16)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_windows(self) -> int:
        return 2 * self.num_layers + 1

    def forward_window(self, layer: int) -> int:
        return layer

    def backward_window(self, layer: int) -> int:
        return 2 * self.num_layers - 1 - layer

    @property
    def optimizer_window(self) -> int:
        return 2 * self.num_layers

    def activation_write_windows(self, layer: int) -> range:
        """Windows an offloaded activation may be copied out in: its forward until the last forward."""
        return range(layer, self.num_layers)

    def activation_read_windows(self, layer: int) -> range:
        """Windows it may come back in: backward windows of later layers, before its own backward.
        Empty for the last layer, which therefore never offloads."""
        return range(self.num_layers, self.backward_window(layer))

    def param_swap_tier(self) -> str:
        return self.host_tier()

    def host_tier(self) -> str:
        """Where host memory is planned: the "cpu" tier where there is one, else the compute memory."""
        return "cpu" if self.machine.has_host else "gpu"

    def snapshot_layer_bytes(self, layer: int, placement: Placement) -> int:
        """Host bytes of the snapshot that layer `layer`'s state adds under `placement` (no limit)."""
        if self.snapshot is None:
            return 0
        from lazyzero.checkpoint.snapshot import snapshot_host_bytes

        written = self.layers[layer].snapshot_bytes(placement.state_8bit)
        copied = placement.state_tier == "nvme" or (placement.state_tier == "gpu" and self.machine.has_host)
        return snapshot_host_bytes(written if copied else 0, written, 0, self.snapshot.block_bytes,
                                   max_in_flight=self.snapshot.max_in_flight)

    def snapshot_other_bytes(self) -> int:
        """Host bytes of the snapshot besides the layers' states (no limit)."""
        if self.snapshot is None:
            return 0
        from lazyzero.checkpoint.snapshot import snapshot_host_bytes

        memory = self.snapshot
        return snapshot_host_bytes(0, memory.other_bytes, memory.files, memory.block_bytes,
                                   max_in_flight=memory.max_in_flight)

    def snapshot_held(self, placements) -> int:
        """Host bytes the snapshot holds with these placements (LayerPlans or Placements), at most
        `host_buffer_limit`."""
        if self.snapshot is None:
            return 0
        held = self.snapshot_other_bytes() + sum(
            self.snapshot_layer_bytes(i, Placement(p.param_tier, p.state_tier, p.state_8bit))
            for i, p in enumerate(placements))
        return held if self.snapshot.limit_bytes is None else min(held, self.snapshot.limit_bytes)

    def param_swap_held(self, layers) -> float:
        """`param_swap_bytes` if any of the chosen layers has its parameters on NVMe, else 0."""
        return self.param_swap_bytes if any(lp.param_tier == "nvme" for lp in layers) else 0

    def checkpoint_route(self) -> tuple[str, ...]:
        """Snapshot traffic goes to host memory, or to NVMe on a machine without one."""
        return self.machine.route_down("cpu" if self.machine.has_host else "nvme")


class ActChoice(NamedTuple):
    mode: str  # "keep" or "recompute"
    bits: int
    tier: str


class Placement(NamedTuple):
    param_tier: str
    state_tier: str
    state_8bit: bool


@dataclass(frozen=True)
class LayerPlan:
    """One layer's choices. A recomputed layer keeps its input on the device: act_bits 16, act_tier gpu."""

    act_mode: str
    act_bits: int
    act_tier: str
    param_tier: str
    state_tier: str
    state_8bit: bool

    def __post_init__(self):
        _require_one_of(self, ("act_mode",), ("keep", "recompute"))
        _require_one_of(self, ("act_bits",), BIT_WIDTHS)
        _require_one_of(self, ("act_tier", "param_tier", "state_tier"), TIER_NAMES)
        if self.act_mode == "recompute":
            _require(self.act_bits == 16 and self.act_tier == "gpu", "act_mode",
                     "a recomputed layer has act_bits 16 and act_tier 'gpu'")

    @classmethod
    def of(cls, act: ActChoice, placement: Placement) -> LayerPlan:
        return cls(act.mode, act.bits, act.tier, *placement)

    @property
    def act(self) -> ActChoice:
        return ActChoice(self.act_mode, self.act_bits, self.act_tier)

    @property
    def placement(self) -> Placement:
        return Placement(self.param_tier, self.state_tier, self.state_8bit)

    @property
    def offloaded(self) -> bool:
        return self.act_mode == "keep" and self.act_tier != "gpu"


RECOMPUTE = ActChoice("recompute", 16, "gpu")


def activation_options(problem: PlanProblem, layer: int) -> list[ActChoice]:
    """Every allowed way to carry layer `layer`'s activations to its backward."""
    tiers = [t for t in problem.machine.tiers if t == "gpu" or problem.activation_read_windows(layer)]
    options = [ActChoice("keep", bits, tier) for tier in tiers for bits in problem.layer_widths(layer)]
    return options + ([RECOMPUTE] if problem.may_recompute(layer) else [])


def widest_activation(problem: PlanProblem, layer: int, tier: str = "gpu") -> ActChoice:
    """Layer `layer`'s activations kept on `tier` at the widest width it may use, or recomputed
    where it may use none."""
    widths = problem.layer_widths(layer)
    return ActChoice("keep", max(widths), tier) if widths else RECOMPUTE


def placement_options(problem: PlanProblem, layer: int) -> list[Placement]:
    """Every allowed parameter tier x state tier (only the fixed one where `fixed_placements` names
    it); the state 8-bit when allowed and no larger than fp32 and, on that tier, no slower to step
    (the fp32 state is then dominated: more bytes to hold, move and step, at no gain in this model),
    both precisions when 8-bit is smaller but slower."""
    if problem.fixed_placements is not None and problem.fixed_placements[layer] is not None:
        return [Placement(*problem.fixed_placements[layer])]
    tiers = list(problem.machine.tiers)
    params = [t for t in tiers if problem.param_tiers is None or t in problem.param_tiers]
    return [Placement(p, s, eight_bit) for p in params for s in tiers
            for eight_bit in _state_precisions(problem, layer, s)]


def _state_precisions(problem: PlanProblem, layer: int, state_tier: str) -> tuple[bool, ...]:
    costs, machine = problem.layers[layer], problem.machine
    if not problem.allow_8bit_optimizer or costs.optim_state_bytes_8bit > costs.optim_state_bytes_fp32:
        return (False,)
    if optimizer_seconds(machine, costs, state_tier, True) <= optimizer_seconds(machine, costs, state_tier, False):
        return (True,)
    return (True, False)


def optimizer_seconds(machine: Machine, costs: LayerCosts, state_tier: str, eight_bit: bool) -> float:
    return machine.adam_s_per_byte(state_tier, eight_bit) * costs.state_bytes(eight_bit)


class Traffic(NamedTuple):
    window: int
    path: str
    bytes: float
    kind: str = "state"  # "param" for a parameter's copies (priced apart, Machine.nvme_param_bytes_per_s)


def placement_traffic(problem: PlanProblem, layer: int, placement: Placement) -> list[Traffic]:
    """Copies a layer's parameter/state placement causes each step, at fixed windows."""
    machine, costs = problem.machine, problem.layers[layer]
    traffic = []
    if placement.param_tier != "gpu":
        for use in (problem.forward_window(layer), problem.backward_window(layer)):
            window = (use - 1) % problem.num_windows
            traffic += [Traffic(window, p, costs.param_bytes, "param") for p in machine.route_up(placement.param_tier)]
    on_host = machine.optimizer_on_host(placement.state_tier)
    opt = problem.optimizer_window
    if on_host:  # gradients leave in the window after the layer's backward (ZeRO-Offload)
        traffic.append(Traffic(problem.backward_window(layer) + 1, "d2h", costs.grad_bytes))
    if placement.state_tier == "nvme":
        state = costs.state_bytes(placement.state_8bit)
        traffic += [Traffic(opt, "nvme_read", state), Traffic(opt, "nvme_write", state)]
        if machine.grads_leave_device("nvme") and not on_host and not machine.nvme_grads_resident:
            traffic += [Traffic(problem.backward_window(layer) + 1, "nvme_write", costs.grad_bytes),
                        Traffic(opt, "nvme_read", costs.grad_bytes)]
    # The updated 16-bit parameters are produced where the optimizer runs and go home.
    if on_host and placement.param_tier == "gpu":
        traffic.append(Traffic(opt, "h2d", costs.param_bytes, "param"))
    elif on_host and placement.param_tier == "nvme":
        traffic.append(Traffic(opt, "nvme_write", costs.param_bytes, "param"))
    elif not on_host and placement.param_tier != "gpu":
        traffic += [Traffic(opt, p, costs.param_bytes, "param") for p in machine.route_down(placement.param_tier)]
    return traffic


PLACED_KINDS = {"param": "param_tier", "state": "state_tier"}


def check_offload_all_or_none(problem: PlanProblem, layers) -> None:
    """Raise ValueError if, under offload_all_or_none, some layers keep a kind on the device and others not."""
    if not problem.offload_all_or_none:
        return
    for kind, attribute in PLACED_KINDS.items():
        on_device = [i for i, lp in enumerate(layers) if getattr(lp, attribute) == "gpu"]
        if 0 < len(on_device) < len(layers):
            raise ValueError(f"offload_all_or_none: layers {on_device} keep their {kind} tensors on the device and "
                             "the others do not; DeepSpeed offloads all of them or none")


def check_act_widths(problem: PlanProblem, layers) -> None:
    """Raise ValueError if a layer keeps its activations at a width its gradient error bound excludes."""
    for costs, lp in zip(problem.layers, layers):
        if lp.act_mode == "keep" and lp.act_bits not in costs.act_widths:
            raise ValueError(f"layer {costs.name} keeps its activations at {lp.act_bits} bits, whose measured "
                             f"gradient error exceeds the bound (it may use {costs.act_widths})")


def blocking_seconds(problem: PlanProblem, traffic: Traffic) -> float:
    """Seconds a placement copy adds to its window's time (0 where copies overlap compute)."""
    machine = problem.machine
    if not (machine.nvme_swaps_block and traffic.path.startswith("nvme")):
        return 0.0
    if traffic.kind == "param" and machine.nvme_param_bytes_per_s is not None:
        return traffic.bytes / machine.nvme_param_bytes_per_s
    return traffic.bytes / machine.paths[traffic.path].bytes_per_s


def optimizer_step_s(problem: PlanProblem, layer: int, placement: Placement) -> float:
    rate = problem.machine.adam_s_per_byte(placement.state_tier, placement.state_8bit)
    return rate * problem.layers[layer].state_bytes(placement.state_8bit)


def quality_cost(problem: PlanProblem, layers: tuple[LayerPlan, ...]) -> float:
    return sum(costs.quality_cost[lp.act_bits] for costs, lp in zip(problem.layers, layers) if lp.act_mode == "keep")


@dataclass(frozen=True)
class ActTransfer:
    """`bytes` of layer `layer`'s activations moved "down" (to its tier) or "up" in `window`."""

    layer: int
    direction: str
    window: int
    bytes: float


@dataclass(frozen=True)
class Plan:
    """A plan and its predictions. checkpoint_transfers[w]: snapshot bytes copied in window w."""

    layers: tuple[LayerPlan, ...]
    act_transfers: tuple[ActTransfer, ...]
    checkpoint_transfers: tuple[float, ...]
    predicted_step_s: float
    predicted_peak_bytes: dict[str, float]
    objective: float
    source: str
    status: str
    gap: float = 0.0
    solve_s: float = 0.0

    def __post_init__(self):
        _require_one_of(self, ("source",), PLAN_SOURCES)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        data["layers"] = tuple(LayerPlan(**lp) for lp in data["layers"])
        data["act_transfers"] = tuple(ActTransfer(**t) for t in data["act_transfers"])
        data["checkpoint_transfers"] = tuple(data["checkpoint_transfers"])
        return cls(**data)


def _shortfall(need: int, capacity: int) -> str:
    return (f"{need / 1e9:.2f} GB ({need} bytes), capacity {capacity / 1e9:.2f} GB: "
            f"short by {(need - capacity) / 1e9:.2f} GB")


def budget_shortfalls(problem: PlanProblem) -> PlanInfeasible:
    """Explain why no plan exists, from lower bounds on what each tier must hold."""
    machine, layers = problem.machine, problem.layers
    device_floor = problem.workspace_bytes + max(c.grad_bytes for c in layers)
    gpu_cap = machine.tiers["gpu"].capacity_bytes
    if device_floor > gpu_cap:
        return PlanInfeasible(f"gpu budget too small: the workspace and one layer's gradients need "
                              f"{_shortfall(device_floor, gpu_cap)}", ("gpu",))
    smallest_state = [c.state_bytes(problem.allow_8bit_optimizer) for c in layers]
    total_floor = (problem.workspace_bytes + sum(c.param_bytes + c.grad_bytes for c in layers)
                   + sum(smallest_state))
    total_cap = sum(t.capacity_bytes for t in machine.tiers.values())
    if total_floor > total_cap:
        return PlanInfeasible(f"all tiers together too small: parameters, gradients, smallest optimizer "
                              f"states and workspace need {_shortfall(total_floor, total_cap)}", tuple(machine.tiers))
    return PlanInfeasible(f"the budgets of {sorted(machine.tiers)} together admit no plan "
                          "(no single tier's lower bound is exceeded)", tuple(machine.tiers))
