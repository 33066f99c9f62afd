"""The "lazyzero" section of a DeepSpeed config: one pydantic model per capability, every feature off by default.

Why not DeepSpeed's `DeepSpeedConfigModel` (deepspeed/runtime/config_utils.py) as the base class:
- its `__init__(strict=False, **data)` silently drops every value equal to "auto", so
  `"gpu_mem": "auto"` would fall back to the default instead of being rejected, and it takes a
  key named "strict" as its own argument, so `{"strict": 1}` in any sub-section is swallowed
  instead of reported as unknown (both checked against DeepSpeed 0.19.8, also for nested models);
- importing it imports torch and DeepSpeed (about 3 s), which `lazyzero config check` must not pay;
- its one addition, renamed/deprecated fields, keeps accepting an old spelling, where lazyzero refuses
  it naming the new key (`ConfigSection.retired_keys`), so that one spelling stays in use.
So the models use pydantic's BaseModel with the same `extra="forbid"`, plus strict types: JSON has
real booleans and numbers, and "yes" or "4" are more likely mistakes than intentions.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from lazyzero.config.fieldtypes import LayerIndices, LayerKey, MemorySize, MemorySizeAtLeast, NonEmptyStr, PowerOfTwo


class ConfigSection(BaseModel):
    """Base of every model in the "lazyzero" section.

    Every capability is switched by its own `enabled: bool = False`. Spellings the switches had
    before are refused, through the usual problem lines, with a hint naming the key to use instead.
    """

    retired_keys: ClassVar[dict[str, str]] = {}
    """Removed key -> what to write instead (the problem reads "<path>: removed; <hint>")."""

    retired_values: ClassVar[dict[str, dict[Any, str]]] = {}
    """Field -> {value it no longer takes -> hint added to the problem after what is allowed}."""

    planned_fields: ClassVar[tuple[str, ...]] = ()
    """Fields the memory planner sets when `lazyzero.plan.enabled` is true (lazyzero/config/plan_checks.py):
    a value given for one is refused, and a new plan replaces them while the section's other fields stay."""

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
    """Let the planner choose placement and precision per layer within the budgets below (needs ZeRO stage 3 and
    `seq_len`)."""

    seq_len: Optional[int] = Field(None, ge=1)
    """Tokens per training sequence: the planner profiles and plans micro-batches of this shape. Required with
    `enabled`."""

    gpu_mem: Optional[MemorySize] = None
    """GPU memory budget per rank. null: the device's total memory. Not allowed on a machine without CUDA."""

    cpu_mem: Optional[MemorySize] = None
    """CPU memory budget per node, shared by its ranks (on a machine without a GPU, the memory training computes
    in). null: the machine's total memory."""

    headroom_share: Optional[float] = Field(None, ge=0, le=1)
    """Compute-memory budget measured on this machine instead of given in bytes: this share of the way from the
    least budget that admits a plan (0) to what the plan with every tensor in memory needs (1), both from the run's
    own profile, so that one config holds wherever it runs (another torch build or library version moves both). It
    takes the place of `cpu_mem` on a machine without a GPU and of `gpu_mem` on CUDA, which must then be null. null:
    the byte budgets decide."""

    nvme_path: Optional[NonEmptyStr] = None
    """Existing, writable folder the planner may spill tensors to. null: no NVMe tier."""

    memory_reserve: float = Field(0.1, ge=0, lt=1)
    """Share of the compute-memory budget left unplanned, for what the planner's memory model does not see (library
    buffers, allocator slack): the predicted peak stays under (1 - memory_reserve) x the budget."""

    allowed_bits: list[Literal[4, 8, 16]] = Field(default_factory=lambda: [16, 8, 4], min_length=1)
    """Widths the planner may store saved activations at (16 keeps them as saved)."""

    max_grad_error: float = Field(0.02, gt=0)
    """Most gradient error a layer's activation width may cost: the profile measures, for each layer of the run's own
    model, the relative L2 error of its parameter and input gradients with its activations stored at 8 and at 4 bits,
    and the planner does not give a layer a width whose error exceeds this (16 bits and recompute are exact and always
    allowed). 0.02 keeps 8 bits (at most 0.007 per layer on SmolLM2-135M and the demo preset) and excludes 4 bits (at
    least 0.036 there; the whole model's error at 4 bits, 0.07-0.13, misses the 0.03 target): docs/plan.md."""

    allow_recompute: bool = True
    """Let the planner recompute whole layers in backward instead of storing their activations."""

    allow_8bit_optimizer: bool = True
    """Let the planner give layers 8-bit Adam states (lazyzero's AdamW8bit/Adam8bit) instead of fp32."""

    time_limit_s: float = Field(10.0, gt=0)
    """Wall-clock limit of the MILP solver in seconds; the best plan found by then is used."""

    max_gap: float = Field(0.01, ge=0, le=1)
    """Relative optimality gap at which the solver stops (0.01: within 1% of the optimum)."""

    profile_path: Optional[NonEmptyStr] = None
    """Profile file (`lazyzero profile`): reused when model, run shape and machine match, else measured at start and
    written there. null: measured at start, kept in ~/.cache/lazyzero/profiles."""

    plan_path: Optional[NonEmptyStr] = None
    """A plan.json (from `lazyzero plan --profile`, or a planned run's `output_dir`) to apply instead of solving at
    start; it must fit this model and these budgets. null: solve."""

    output_dir: Optional[NonEmptyStr] = None
    """Folder where rank 0 writes plan.json, the DeepSpeed config the plan implies and memory.png at start. null:
    not written (the plan is printed)."""

    measure_steps: int = Field(3, ge=1)
    """Optimizer steps, after the first, over which measured step time and peak memory are compared with the
    prediction."""

    replan: bool = True
    """Plan again, with the measurements, when they differ from the prediction by more than `replan_margin` in two
    checks in a row and in the median over the plan's checks, which the new plan is calibrated with (activation
    choices only: placements are fixed once DeepSpeed is built)."""

    replan_margin: float = Field(0.15, gt=0)
    """Relative difference between measured and predicted step time or peak memory that triggers a new plan."""

    checkpoint_every: Optional[int] = Field(None, ge=1)
    """Optimizer steps between the run's lazy checkpoints: the planner spreads each snapshot's copy traffic over the
    compute windows of that many steps, beside the other transfers. null: none planned
    (`lazyzero train --save-every N` sets it)."""


class ActivationsConfig(ConfigSection):
    """Block-wise 4/8-bit quantization of the activations saved for backward, chosen per layer."""

    planned_fields = ("enabled", "default_bits", "overrides", "recompute_layers", "offload_layers",
                      "offload_nvme_path")

    enabled: bool = False
    """Quantize saved activations (through saved-tensor hooks) as set below."""

    default_bits: Literal[4, 8, 16] = 8
    """Bits per saved activation for modules no `overrides` pattern matches (MLPs and the rest of each layer); 16
    keeps them unquantized. 4 halves their bytes but, on pretrained LLMs, gives about ten times the gradient error
    of 8 (docs/activations.md)."""

    attention_bits: Literal[8, 16] = 8
    """Bits for the query and key an attention call saves, which rebuild its softmax (too sensitive for 4 bits):
    stored in blocks along tokens within each channel, each block centred, where pretrained models' large key
    channels cost no precision; 16 keeps them exact. The logsumexp, and every tensor of an attention that does not
    call SDPA (eager attention), stay exact (docs/activations.md)."""

    attention_input_bits: Optional[Literal[4, 8, 16]] = None
    """Bits for the attention module's input (the output of the norm before it, read only by the q/k/v projections'
    weight gradients); unset: the layer's norm width, and rebuilt from the norm's stored input at no cost where
    `recompute_elementwise` applies; 16 keeps it exact. Attention's own tensors (q, k, v, output) keep
    `attention_bits` or `attention_value_bits`."""

    attention_value_bits: Literal[8, 16] = 8
    """Fewest bits for the attention's value, its output and the output projection's input, which only sums over the
    head dimension read (q and k, which rebuild the softmax, keep `attention_bits`); a wider layer width applies, so
    a layer kept at 16 bits keeps them exact. 16: kept exact."""

    norm_bits: Literal[4, 8, 16] = 8
    """Fewest bits for tensors saved by norms (their input is the residual stream, whose outlier channels 4-bit
    blocks handle worst); a wider layer width applies."""

    block_size: PowerOfTwo(32, 4096) = 64
    """Elements sharing one scale; smaller blocks follow local magnitudes more closely (at most 256 with
    `keep_outliers`)."""

    keep_outliers: bool = True
    """Store each block's largest-magnitude element exactly (its value in the tensor's dtype and a one-byte index: 3
    bytes per block in bf16) and scale the block by the rest, so that one value thousands of times larger than its
    neighbours, as pretrained LLMs' residual streams carry, costs the others no precision."""

    fused_loss: bool = True
    """Compute a causal LM's cross-entropy loss and its gradients together in forward, a chunk of tokens at a time,
    so that no logits are kept for backward (they are the largest saved tensor of a model with a large vocabulary).
    Applies to transformers causal LMs called with `labels` while autograd records; their output then has no
    `logits`."""

    stochastic_rounding: bool = False
    """Round to a neighbouring code at random (unbiased) instead of to the nearest one."""

    overrides: dict[NonEmptyStr, Literal[4, 8, 16]] = Field(default_factory=dict)
    """Bits per module: module-name glob pattern (fnmatch, e.g. "model.layers.0.*") -> bits; the first matching
    pattern, in the order written, wins."""

    recompute_layers: LayerIndices = Field(default_factory=list)
    """Layers whose activations are recomputed in backward instead of saved."""

    recompute_elementwise: bool = True
    """In quantized modules, store only what cheap elementwise work cannot rebuild: norms keep just their input,
    gated MLPs drop act(gate) and the product (rebuilt in backward, no extra matmul)."""

    offload_layers: dict[LayerKey, Literal["cpu", "nvme"]] = Field(default_factory=dict)
    """Layers whose stored activations (packed, or kept at 16 bits) leave the device right after they are saved and
    are read back ahead of their backward: layer index -> "cpu" (pinned host memory; on a machine without CUDA they
    already are in host memory and stay there) or "nvme" (files under `offload_nvme_path`). Not for layers in
    `recompute_layers`."""

    offload_nvme_path: Optional[NonEmptyStr] = None
    """Existing, writable folder for the files of the "nvme" layers (one sub-folder per rank and process, removed
    when training ends); required when a layer says "nvme"."""

    offload_prefetch_layers: int = Field(1, ge=0)
    """How far ahead backward reads offloaded activations: when layer j's backward starts, the reads of layer j
    (those not asked yet) and of layers j-1 to j-N start. 0: each tensor is read when backward needs it."""


class GradientsConfig(ConfigSection):
    """Gradient reduce-scatter as an int8 all-to-all followed by a local dequantize-and-sum."""

    retired_keys = {"quantize": "use lazyzero.gradients.enabled: true (int8 is the wire format)"}

    enabled: bool = False
    """Send gradients in int8 in the reduce-scatter; false keeps DeepSpeed's own collective."""

    # 256 values per fp32 scale adds 4/256 = 1.6% to the traffic while the error bound (half a
    # block's scale, docs/reliability.md, what is tested) stays local; 2048 would save only 1.4% more bandwidth but
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

    retired_values = {"type": {"none": "switch the 8-bit optimizer off with lazyzero.optimizer.enabled: false"}}
    planned_fields = ("enabled", "type", "fraction_8bit")

    enabled: bool = False
    """Replace DeepSpeed's Adam or AdamW (hyper-parameters from its "optimizer" section) by the 8-bit `type`; false
    keeps it."""

    type: Literal["adamw8bit", "adam8bit"] = "adamw8bit"
    """The 8-bit optimizer: "adamw8bit" (decoupled weight decay, as AdamW) or "adam8bit" (L2 decay, as Adam)."""

    block_size: PowerOfTwo(32, 4096) = 256
    """State elements sharing one scale."""

    min_8bit_size: int = Field(4096, ge=0)
    """Parameters with fewer elements keep fp32 states (the scales would outweigh the saving)."""

    fp32_patterns: list[NonEmptyStr] = Field(default_factory=lambda: ["*embed*", "*norm*"])
    """Parameter-name glob patterns (fnmatch) whose states stay fp32; embeddings and norms are sensitive to
    quantization."""

    fraction_8bit: Optional[float] = Field(None, ge=0, le=1)
    """Fraction of the eligible parameters' elements given 8-bit states, largest tensors first. null: all."""

    fused_clipping: bool = True
    """Compute the gradient norm and clip inside the fused step instead of in a separate pass."""


# The checkpoint writer's staging block (lazyzero/checkpoint/staged_io.py): the least snapshot memory.
STAGING_BLOCK_BYTES = 8 << 20


class CheckpointConfig(ConfigSection):
    """Lazy asynchronous checkpoints: snapshot to host memory, write and commit in the background."""

    retired_keys = {"mode": "use lazyzero.checkpoint.enabled: true for lazy checkpoints (false: DeepSpeed's own)"}

    enabled: bool = False
    """Lazy checkpoints: save returns once the snapshot is taken; false keeps DeepSpeed's checkpoint engine."""

    keep_last: Optional[int] = Field(None, ge=1)
    """Keep the newest N committed checkpoints and delete older ones. null: keep all."""

    host_buffer_limit: Optional[MemorySizeAtLeast(STAGING_BLOCK_BYTES, "one 8 MiB staging block")] = None
    """Host memory for the snapshot: buffers of device tensors, views and NVMe swap files, and the staging blocks
    files are written through (at least one 8 MiB block; at the limit they wait for the disk). null: as much as one
    snapshot needs."""

    max_in_flight: int = Field(1, ge=1)
    """Snapshots that may be queued or being written at once; a further save waits."""

    writer_threads: int = Field(2, ge=1, le=64)
    """Threads writing checkpoint files in the background."""

    verify_on_load: bool = True
    """Check every file's size and hash against the manifest before loading (docs/reliability.md, guarantee 2)."""

    allow_unverified: bool = False
    """With lazy checkpoints: load a tag that has no manifest (a plain DeepSpeed checkpoint, or a folder lazyzero
    never committed), whose files nothing can verify. Off, such a tag is refused with an error naming it."""

    allow_pickle: bool = False
    """Load checkpoint files that hold types other than tensors, containers, numbers and DeepSpeed's few
    (lazyzero/safe_load.py). Loading such a file runs code it names: only for folders you trust."""

    exit_timeout_s: float = Field(1800.0, ge=1)
    """Seconds the end of a job (the Trainer's train() returning, engine.destroy(), the world process group destroyed,
    the interpreter's exit, a SIGTERM stop) waits for queued checkpoints to commit, saying every 10 s what it waits
    for; past it the checkpoint is reported uncommitted and the process exits with status 1."""

    save_on_sigterm: bool = False
    """On SIGTERM (a cluster's preemption) every rank stops at the next optimizer step all of them reach, commits
    the checkpoints in flight and exits with status 143; true also saves one more checkpoint at that step first (the
    Trainer's next checkpoint-N folder, or DeepSpeed's default tag in the folder of the engine's last save)."""

    on_damaged_latest: Literal["stop", "fall_back"] = "stop"
    """When the checkpoint a resume picks by itself (the tag 'latest' names) is damaged (a file or its manifest
    differs, or is a symbolic link): "stop" refuses to load, naming what is damaged; "fall_back" loads the newest
    older committed checkpoint that verifies, with a warning naming the damage (docs/reliability.md, guarantee 2).
    A tag given by name is never replaced."""


class DistributedConfig(ConfigSection):
    """How long a rank waits for the others: the job's collectives, with or without any capability on."""

    timeout_s: float = Field(300.0, ge=1)
    """Seconds any collective (training, the lazy checkpoints' agreement) may wait for the other ranks before it
    raises and this rank exits non-zero: a rank that died or was stopped (SIGSTOP) ends the job after this long
    instead of DeepSpeed's 30 minutes (docs/reliability.md, guarantee 5). Set it above the longest time one rank can
    keep the others waiting in a collective (a native op build on first use, a non-lazy save of a large model)."""


# The capabilities, each switched by its section's `enabled`, in the order they are reported.
FEATURES = ("plan", "activations", "gradients", "optimizer", "checkpoint")


class LazyZeroConfig(ConfigSection):
    """The validated "lazyzero" section, as the engine receives it.

    Build it with `validate_ds_config`, which also applies the checks against
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

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """The ranks' collectives."""

    def enabled_features(self) -> list[str]:
        """Names of the capabilities switched on, in the order of `FEATURES` (empty: plain DeepSpeed)."""
        return [section for section in FEATURES if getattr(self, section).enabled]
