"""What a planner profile holds (docs/plan.md): measured per-layer costs, machine speeds and the
fingerprint that says which model and machine they are valid for; JSON in and out.

Units everywhere: seconds (`*_s`, `s_per_*`), bytes (`*_bytes`), bytes per second (`bytes_per_s`).
Activation tables are keyed by the packer's default width (16, 8, 4). `lazyzero.plan.profile.profiler`
measures and caches these; `problem_from_profile` turns them into a `PlanProblem`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import asdict, dataclass

PROFILE_KIND = "lazyzero.profile"
# Raised whenever what a profile measures, or what its figures mean, changes: a cached profile of
# another version is refused and measured again (`ModelProfile.from_json`), never reinterpreted
# (docs/plan.md, "How it works"; what each version added: the profile versions in
# benchmarks/results/records/2026-12-02-planner-calibration-notes.md).
PROFILE_VERSION = 8
DECODER = "decoder"
EMBED_AND_HEAD_KIND = "embed_and_head"


@dataclass(frozen=True)
class TensorInfo:
    """One parameter tensor: its full (unpartitioned) element count and dtype (e.g. "bfloat16")."""

    numel: int
    dtype: str


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer for one micro-batch of the run's shape, on one rank.

    Decoder layers (`kind` "decoder"): the layer alone, fed hidden states and the rotary
    embeddings / mask exactly as the model passes them. `embed_and_head`: the model with every
    decoder layer replaced by a pass-through: embedding, mask and rotary set-up, final norm,
    lm_head and loss.

    fwd_s, bwd_s: training forward (autograd recording) and backward (weight and input gradients),
      no packer. recompute_s: the forward torch's non-reentrant checkpoint reruns inside backward,
      timed there; checkpointed_fwd_s / _bwd_s: the layer under that checkpoint (the backward includes
      the recompute). None for embed_and_head, which is never recomputed.
    packed_fwd_s[b], packed_bwd_s[b]: the same under lazyzero's ActivationPacker with default_bits b
      (16: only the packer's hooks); minus fwd_s / bwd_s, what packing costs.
    act_bytes[b]: saved-activation bytes as the packer stores them at default_bits b (attention at
      16, norms at least norm_bits). Tensors every layer receives (rotary cos/sin, mask) are not
      included: they are stored once per forward, see `ModelProfile.shared_saved_bytes`.
    input_bytes: what a recomputed layer keeps (its input hidden states); output_bytes: its output.
    transient_fwd_bytes / _bwd_bytes: peak live memory during the phase above the larger of what
      the phase starts and ends with (temporaries); None where it could not be measured.
    measured_as: the layer whose measurement this row carries (layers of one shape are measured once).
    offloaded_fwd_s / _bwd_s: the layer with its stored activations (16 bits) offloaded to the NVMe
      folder through lazyzero's offloader (its reads start when the layer's backward does, so a
      read that the previous layer's backward would hide in training is waited for here); None
      without an NVMe folder.
    grad_error[b]: what storing this layer's activations at default_bits b does to its gradients,
      measured for this very layer (not per shape: it depends on the layer's weights and inputs) with
      the exact gradient its output gets on the profiling batch: the larger of the relative L2 errors
      of its parameter gradients (together) and of its input gradient (grad_error.py). 16 -> 0.0;
      all 0.0 for embed_and_head, which is never packed.
    """

    name: str
    kind: str
    measured_as: str
    fwd_s: float
    bwd_s: float
    recompute_s: float | None
    checkpointed_fwd_s: float | None
    checkpointed_bwd_s: float | None
    packed_fwd_s: dict[int, float]
    packed_bwd_s: dict[int, float]
    act_bytes: dict[int, int]
    input_bytes: int
    output_bytes: int
    transient_fwd_bytes: int | None
    transient_bwd_bytes: int | None
    tensors: dict[str, TensorInfo]
    grad_error: dict[int, float]
    offloaded_fwd_s: float | None = None
    offloaded_bwd_s: float | None = None

    @property
    def param_numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())


@dataclass(frozen=True)
class Bandwidth:
    """One copy path: `test_bytes` moved per run, median `seconds`, `bytes_per_s` = test_bytes / seconds."""

    bytes_per_s: float
    test_bytes: int
    seconds: float


@dataclass(frozen=True)
class OptimizerSpeed:
    """One optimizer step over `elements` fp32 parameters (a few tensors) on `device`.

    state_bytes_per_param: the optimizer's own state tensors (moments, codes, scales; not the
    parameters themselves), as measured after a step. backend: how the step ran ("native",
    "reference", "torch", "deepspeed").
    """

    device: str
    elements: int
    step_s: float
    s_per_param: float
    state_bytes_per_param: float
    s_per_state_byte: float
    backend: str


@dataclass(frozen=True)
class CollectiveSpeed:
    """A ZeRO-3 collective on the default group over a layer-sized buffer of `full_bytes` (the whole,
    unpartitioned buffer), through deepspeed.comm's allgather_fn / reduce_scatter_fn."""

    world_size: int
    dtype: str
    full_bytes: int
    seconds: float
    s_per_byte: float


@dataclass(frozen=True)
class NvmeSetup:
    """Where the NVMe test ran: the folder, the aio settings (DeepSpeed's "aio" keys), the file size."""

    path: str
    aio: dict[str, typing.Any]
    file_bytes: int


@dataclass(frozen=True)
class MachineProfile:
    """Speeds of this machine as one training rank sees them (all ranks of a host measure at once).

    bandwidths: "host_copy" (one large copy_ in host memory: bytes copied per second, each read once
    and written once), "nvme_write" / "nvme_read" (DeepSpeed aio with pinned buffers, O_DIRECT),
    and on CUDA "h2d" / "d2h" (pinned host memory). optimizers: by name, see OptimizerSpeed.
    collectives: "all_gather", "reduce_scatter" when world size > 1. skipped: measurement -> why not.
    """

    device_type: str
    device_name: str
    threads: int
    host_memory_bytes: int
    bandwidths: dict[str, Bandwidth]
    nvme: NvmeSetup | None
    optimizers: dict[str, OptimizerSpeed]
    collectives: dict[str, CollectiveSpeed]
    skipped: dict[str, str]


@dataclass(frozen=True)
class MemorySnapshot:
    """This rank's memory when profiling started: resident set, and the model's parameter and
    buffer bytes as they were (whatever device, dtype or partitioning they had)."""

    rss_bytes: int
    param_bytes: int
    buffer_bytes: int


@dataclass(frozen=True)
class EngineRun:
    """A real DeepSpeed engine of the model cut to `layers` decoder layers (engine_calibration.py):
    median `step_s` over the timed steps, the process's peak resident set over them, its resident
    set before the engine was built, and the bytes of the model's parameters it was given (in
    `before_bytes`; ZeRO-3 frees them as it partitions). `nvme`: its decoder layers' parameters and
    optimizer state were on NVMe (else every tensor was in memory); with `params_only`, only their
    parameters."""

    layers: int
    step_s: float
    peak_bytes: int
    before_bytes: int
    model_bytes: int
    nvme: bool = False
    params_only: bool = False


@dataclass(frozen=True)
class EngineCalibration:
    """The engine runs and the DeepSpeed config they were built with."""

    runs: tuple[EngineRun, ...]
    config: dict[str, typing.Any]


@dataclass(frozen=True)
class Fingerprint:
    """What a profile is valid for; a cached profile is reused only when every field is equal."""

    model_config_sha256: str
    micro_batch: int
    seq_len: int
    dtype: str
    threads: int
    world_size: int
    torch_version: str
    deepspeed_version: str
    lazyzero_version: str
    device_name: str
    nvme_path: str | None
    settings_sha256: str

    def differences(self, other: Fingerprint) -> list[str]:
        """'field: X here, Y there' for every field that differs."""
        return [f"{f.name}: {getattr(self, f.name)!r} in the file, {getattr(other, f.name)!r} now"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class ModelProfile:
    """A measured profile. `layers`: the decoder layers in order, then `embed_and_head`.

    shared_saved_bytes[b]: tensors every decoder layer receives and saves (rotary cos/sin, mask),
    stored once per forward pass (the packer counts them in layer 0). settings: how it was measured.
    engine: real engines of the model cut to a few layers, when a calibration config was given.
    """

    fingerprint: Fingerprint
    layers: tuple[LayerProfile, ...]
    shared_saved_bytes: dict[int, int]
    machine: MachineProfile
    memory: MemorySnapshot
    settings: dict[str, typing.Any]
    profile_s: float
    engine: EngineCalibration | None = None
    kind: str = PROFILE_KIND
    version: int = PROFILE_VERSION

    def layer(self, name: str) -> LayerProfile:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"profile has no layer {name!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        """Raises ValueError (bad JSON, wrong kind or fields) or TypeError (wrong field types)."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
            raise ValueError(f"not a lazyzero profile (no \"kind\": {PROFILE_KIND!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r}, this lazyzero reads version "
                             f"{PROFILE_VERSION} (it measures more): profile again")
        return decode(cls, data)


def decode(kind, value):
    """`value` (parsed JSON) as an instance of the annotated type `kind`: dataclasses field by field,
    dict keys back to int where the annotation says so, lists to tuples, None for optional fields."""
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise TypeError(f"{kind.__name__}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(kind)
        names = {f.name for f in dataclasses.fields(kind)}
        if set(value) - names:
            raise TypeError(f"{kind.__name__}: unknown fields {sorted(set(value) - names)}")
        return kind(**{name: decode(hints[name], item) for name, item in value.items()})
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        return decode(next(o for o in options if o is not type(None)), value)
    if origin is dict:
        key_type, value_type = typing.get_args(kind)
        if not isinstance(value, dict):
            raise TypeError(f"expected an object, got {type(value).__name__}")
        cast = int if key_type is int else (lambda key: key)
        return {cast(key): decode(value_type, item) for key, item in value.items()}
    if origin is tuple:
        return tuple(decode(typing.get_args(kind)[0], item) for item in value)
    if kind is typing.Any:
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value
