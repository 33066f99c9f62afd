"""The memory planner's problem and its answer (issue 7).

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
from dataclasses import asdict, dataclass
from typing import NamedTuple

TIER_NAMES = ("gpu", "cpu", "nvme")
PATH_NAMES = ("d2h", "h2d", "nvme_write", "nvme_read")
BIT_WIDTHS = (16, 8, 4)
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


@dataclass(frozen=True)
class LayerCosts:
    """What one layer costs: compute seconds on the device, and bytes.

    act_bytes[bits]: activations the layer saves for backward when stored at that width.
    input_bytes: what a recomputed layer keeps instead (its input).
    optim_state_bytes_fp32 / _8bit: whatever the caller counts (moments, master weights).
    quality_cost[bits]: penalty per step, in seconds-equivalent, for storing at that width (16 -> 0).
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

    def __post_init__(self):
        _require(bool(self.name), "name", "must be a non-empty string")
        _require_nonnegative(self, ("fwd_s", "bwd_s", "input_bytes", "param_bytes", "grad_bytes",
                                    "optim_state_bytes_fp32", "optim_state_bytes_8bit"))
        for field_name in ("act_bytes", "quality_cost"):
            table = getattr(self, field_name)
            _require(set(table) == set(BIT_WIDTHS), field_name, f"needs exactly the keys {BIT_WIDTHS}")
            _require(all(v >= 0 for v in table.values()), field_name, "values must be >= 0")
        _require(self.quality_cost[16] == 0, "quality_cost", "16 bits is the reference: its cost must be 0")

    def state_bytes(self, eight_bit: bool) -> int:
        return self.optim_state_bytes_8bit if eight_bit else self.optim_state_bytes_fp32


@dataclass(frozen=True)
class Tier:
    name: str
    capacity_bytes: int

    def __post_init__(self):
        _require(self.name in TIER_NAMES, "name", f"got {self.name!r}; allowed: {TIER_NAMES}")
        _require_nonnegative(self, ("capacity_bytes",))


@dataclass(frozen=True)
class Path:
    name: str
    bytes_per_s: float

    def __post_init__(self):
        _require(self.name in PATH_NAMES, "name", f"got {self.name!r}; allowed: {PATH_NAMES}")
        _require(self.bytes_per_s > 0, "bytes_per_s", f"must be > 0, got {self.bytes_per_s!r}")


@dataclass(frozen=True)
class Machine:
    """Memory tiers, copy paths and optimizer speeds.

    "gpu" is always the compute memory. A CPU-only machine is {"gpu" (host memory under the training
    budget), "nvme"}: then NVMe copies go straight to and from the compute memory, the optimizer runs
    there, and there are no d2h/h2d paths.
    """

    tiers: dict[str, Tier]
    paths: dict[str, Path]
    cpu_adam_s_per_byte: float
    gpu_adam_s_per_byte: float

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

    @property
    def has_host(self) -> bool:
        return "cpu" in self.tiers

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


@dataclass(frozen=True)
class PlanProblem:
    layers: tuple[LayerCosts, ...]
    machine: Machine
    workspace_bytes: int
    checkpoint_bytes_per_step: int = 0
    allowed_bits: tuple[int, ...] = BIT_WIDTHS
    allow_recompute: bool = True
    allow_8bit_optimizer: bool = True

    def __post_init__(self):
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "allowed_bits", tuple(self.allowed_bits))
        _require(len(self.layers) > 0, "layers", "needs at least one layer")
        names = [layer.name for layer in self.layers]
        _require(len(set(names)) == len(names), "layers", "layer names must be unique")
        _require_nonnegative(self, ("workspace_bytes", "checkpoint_bytes_per_step"))
        _require(bool(self.allowed_bits) and set(self.allowed_bits) <= set(BIT_WIDTHS), "allowed_bits",
                 f"must be a non-empty subset of {BIT_WIDTHS}, got {self.allowed_bits!r}")

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
        _require(self.act_mode in ("keep", "recompute"), "act_mode", f"got {self.act_mode!r}")
        _require(self.act_bits in BIT_WIDTHS, "act_bits", f"got {self.act_bits!r}; allowed {BIT_WIDTHS}")
        for name in ("act_tier", "param_tier", "state_tier"):
            _require(getattr(self, name) in TIER_NAMES, name, f"got {getattr(self, name)!r}")
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
    options = [ActChoice("keep", bits, tier) for tier in tiers for bits in problem.allowed_bits]
    return options + ([RECOMPUTE] if problem.allow_recompute else [])


def placement_options(problem: PlanProblem, layer: int) -> list[Placement]:
    """Every parameter tier x state tier; the state 8-bit when allowed and no larger than fp32 (the
    fp32 state is then dominated: more bytes to hold, move and step, at no gain in this model)."""
    tiers = list(problem.machine.tiers)
    costs = problem.layers[layer]
    eight_bit = problem.allow_8bit_optimizer and costs.optim_state_bytes_8bit <= costs.optim_state_bytes_fp32
    return [Placement(p, s, eight_bit) for p in tiers for s in tiers]


class Traffic(NamedTuple):
    window: int
    path: str
    bytes: float


def placement_traffic(problem: PlanProblem, layer: int, placement: Placement) -> list[Traffic]:
    """Copies a layer's parameter/state placement causes each step, at fixed windows."""
    machine, costs = problem.machine, problem.layers[layer]
    traffic = []
    if placement.param_tier != "gpu":
        for use in (problem.forward_window(layer), problem.backward_window(layer)):
            window = (use - 1) % problem.num_windows
            traffic += [Traffic(window, p, costs.param_bytes) for p in machine.route_up(placement.param_tier)]
    on_host = machine.optimizer_on_host(placement.state_tier)
    opt = problem.optimizer_window
    if on_host:  # gradients leave in the window after the layer's backward (ZeRO-Offload)
        traffic.append(Traffic(problem.backward_window(layer) + 1, "d2h", costs.grad_bytes))
    if placement.state_tier == "nvme":
        state = costs.state_bytes(placement.state_8bit)
        traffic += [Traffic(opt, "nvme_read", state), Traffic(opt, "nvme_write", state)]
    # The updated 16-bit parameters are produced where the optimizer runs and go home.
    if on_host and placement.param_tier == "gpu":
        traffic.append(Traffic(opt, "h2d", costs.param_bytes))
    elif on_host and placement.param_tier == "nvme":
        traffic.append(Traffic(opt, "nvme_write", costs.param_bytes))
    elif not on_host and placement.param_tier != "gpu":
        traffic += [Traffic(opt, p, costs.param_bytes) for p in machine.route_down(placement.param_tier)]
    return traffic


def optimizer_step_s(problem: PlanProblem, layer: int, placement: Placement) -> float:
    machine = problem.machine
    on_host = machine.optimizer_on_host(placement.state_tier)
    rate = machine.cpu_adam_s_per_byte if on_host else machine.gpu_adam_s_per_byte
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
        _require(self.source in PLAN_SOURCES, "source", f"got {self.source!r}; allowed {PLAN_SOURCES}")

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
