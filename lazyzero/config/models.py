"""The "lazyzero" section of a DeepSpeed config: one pydantic model per capability, every feature off by default.

Why not DeepSpeed's `DeepSpeedConfigModel` (deepspeed/runtime/config_utils.py) as the base class:
- its `__init__(strict=False, **data)` silently drops every value equal to "auto", so
  `"gpu_mem": "auto"` would fall back to the default instead of being rejected, and it takes a
  key named "strict" as its own argument, so `{"strict": 1}` in any sub-section is swallowed
  instead of reported as unknown (both checked against DeepSpeed 0.19.8, also for nested models);
- importing it imports torch and DeepSpeed (about 3 s), which `lazyzero config check` must not pay;
- its one addition, renamed/deprecated fields, has no use in a first release.
So the models use pydantic's BaseModel with the same `extra="forbid"`, plus strict types: JSON has
real booleans and numbers, and "yes" or "4" are more likely mistakes than intentions.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from lazyzero.config.fieldtypes import LayerIndices, MemorySize, NonEmptyStr, PowerOfTwo


class ConfigSection(BaseModel):
    """Base of every model in the "lazyzero" section."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        validate_assignment=True,
    )


class PlanConfig(ConfigSection):
    """MILP memory planner: where each tensor lives (GPU, CPU, NVMe) and at what precision."""

    enabled: bool = False
    """Let the planner choose placement and precision per layer within the budgets below."""

    gpu_mem: Optional[MemorySize] = None
    """GPU memory budget per rank. null: the device's total memory."""

    cpu_mem: Optional[MemorySize] = None
    """CPU memory budget per node, shared by its ranks. null: the machine's total memory."""

    nvme_path: Optional[NonEmptyStr] = None
    """Existing, writable folder the planner may spill tensors to. null: no NVMe tier."""

    time_limit_s: float = Field(10.0, gt=0)
    """Wall-clock limit of the MILP solver in seconds; the best plan found by then is used."""

    max_gap: float = Field(0.01, ge=0, le=1)
    """Relative optimality gap at which the solver stops (0.01: within 1% of the optimum)."""

    profile_path: Optional[NonEmptyStr] = None
    """Per-layer memory and time profile to plan from. null: profile the first training steps."""

    replan_margin: float = Field(0.15, gt=0)
    """Replan when measured peak memory exceeds the planned peak by more than this fraction."""


class ActivationsConfig(ConfigSection):
    """Block-wise 4/8-bit quantization of the activations saved for backward, chosen per layer."""

    enabled: bool = False
    """Quantize saved activations (through saved-tensor hooks) as set below."""

    default_bits: Literal[4, 8, 16] = 4
    """Bits per saved activation for modules no `overrides` pattern matches; 16 keeps them unquantized."""

    attention_bits: Literal[8, 16] = 16
    """Bits for tensors saved by attention, whose softmax is too sensitive for 4 bits."""

    norm_bits: Literal[4, 8, 16] = 8
    """Fewest bits for tensors saved by norms (their input is the residual stream, whose outlier channels 4-bit blocks handle worst); a wider layer width applies."""

    block_size: PowerOfTwo(32, 4096) = 64
    """Elements sharing one scale; smaller blocks follow local magnitudes more closely."""

    stochastic_rounding: bool = False
    """Round to a neighbouring code at random (unbiased) instead of to the nearest one."""

    overrides: dict[NonEmptyStr, Literal[4, 8, 16]] = Field(default_factory=dict)
    """Bits per module: module-name glob pattern (fnmatch, e.g. "model.layers.0.*") -> bits; the first matching pattern, in the order written, wins."""

    recompute_layers: LayerIndices = Field(default_factory=list)
    """Layers whose activations are recomputed in backward instead of saved."""

    recompute_elementwise: bool = True
    """In quantized modules, store only what cheap elementwise work cannot rebuild: norms keep just their input, gated MLPs drop act(gate) and the product (rebuilt in backward, no extra matmul)."""


class GradientsConfig(ConfigSection):
    """Gradient reduce-scatter as an int8 all-to-all followed by a local dequantize-and-sum."""

    quantize: Literal["none", "int8"] = "none"
    """Wire format of gradients in the reduce-scatter; "none" keeps DeepSpeed's own collective."""

    # 256 values per fp32 scale adds 4/256 = 1.6% to the traffic while the error bound (half a
    # block's scale, RELIABILITY row 8) stays local; 2048 would save only 1.4% more bandwidth but
    # let a single outlier coarsen eight times as many values.
    block_size: PowerOfTwo(32, 8192) = 256
    """Gradient elements sharing one fp32 scale."""

    stochastic_rounding: bool = False
    """Round to a neighbouring code at random (unbiased) instead of to the nearest one."""

    seed: int = Field(0, ge=0)
    """Seed of the stochastic rounding noise, combined with rank and step."""

    error_feedback: bool = False
    """Add each rank's quantization error of one step to its gradient of the next step."""

    ranks_per_node: Optional[int] = Field(None, ge=1)
    """Ranks per node for the two-hop layout (inside nodes first, then across). null: from the launcher."""


class OptimizerConfig(ConfigSection):
    """8-bit Adam/AdamW: optimizer states stored block-wise in 8 bits, with a fused step."""

    type: Literal["none", "adam8bit", "adamw8bit"] = "none"
    """Replace DeepSpeed's Adam or AdamW (hyper-parameters from its "optimizer" section); "none" keeps it."""

    block_size: PowerOfTwo(32, 4096) = 256
    """State elements sharing one scale."""

    min_8bit_size: int = Field(4096, ge=0)
    """Parameters with fewer elements keep fp32 states (the scales would outweigh the saving)."""

    fp32_patterns: list[NonEmptyStr] = Field(default_factory=lambda: ["*embed*", "*norm*"])
    """Parameter-name glob patterns (fnmatch) whose states stay fp32; embeddings and norms are sensitive to quantization."""

    fraction_8bit: Optional[float] = Field(None, ge=0, le=1)
    """Fraction of the eligible parameters' elements given 8-bit states, largest tensors first. null: all."""

    fused_clipping: bool = True
    """Compute the gradient norm and clip inside the fused step instead of in a separate pass."""


class CheckpointConfig(ConfigSection):
    """Lazy asynchronous checkpoints: snapshot to host memory, write and commit in the background."""

    mode: Literal["deepspeed", "lazy"] = "deepspeed"
    """Checkpoint engine: "deepspeed" keeps DeepSpeed's; "lazy" returns from save once the snapshot is taken."""

    keep_last: Optional[int] = Field(None, ge=1)
    """Keep the newest N committed checkpoints and delete older ones. null: keep all."""

    host_buffer_limit: Optional[MemorySize] = None
    """Host memory for snapshot buffers. null: as much as one snapshot needs."""

    max_in_flight: int = Field(1, ge=1)
    """Snapshots that may be queued or being written at once; a further save waits."""

    writer_threads: int = Field(2, ge=1, le=64)
    """Threads writing checkpoint files in the background."""

    verify_on_load: bool = True
    """Check every file's size and hash against the manifest before loading (RELIABILITY promise 2)."""


# The field whose value switches each capability on; its default is the "off" value.
FEATURE_SWITCHES = {
    "plan": "enabled",
    "activations": "enabled",
    "gradients": "quantize",
    "optimizer": "type",
    "checkpoint": "mode",
}


class LazyZeroConfig(ConfigSection):
    """The validated "lazyzero" section, as the engine receives it.

    Build it with `validate_ds_config`, which also applies the release gate and the checks against
    the DeepSpeed settings around the section; constructing it directly checks the schema only.
    """

    plan: PlanConfig = Field(default_factory=PlanConfig)
    """Memory planner."""

    activations: ActivationsConfig = Field(default_factory=ActivationsConfig)
    """Activation quantization."""

    gradients: GradientsConfig = Field(default_factory=GradientsConfig)
    """Quantized gradient communication."""

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """8-bit optimizer."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Lazy checkpoints."""

    def enabled_features(self) -> list[str]:
        """Names of the capabilities switched on, in the order of `FEATURE_SWITCHES` (empty: plain DeepSpeed)."""
        return [section for section, switch in FEATURE_SWITCHES.items() if is_switched_on(self, section, switch)]


def is_switched_on(config: LazyZeroConfig, section: str, switch: str) -> bool:
    sub_config = getattr(config, section)
    return getattr(sub_config, switch) != type(sub_config).model_fields[switch].default
