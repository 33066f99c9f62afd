"""The planner's profiler (docs/plan.md): measured costs of a model and machine, cached in a file.

`profile_model` measures, for one micro-batch of the run's shape and with the thread count the
caller runs at (`torch.get_num_threads()`), what the planner needs: per decoder layer forward,
backward and recompute seconds, saved-activation bytes at 16/8/4 bits and what packing costs, the
same for embedding + head, each decoder layer's gradient error at 8 and 4 bits, parameter sizes
per tensor, optimizer step speeds, the bandwidths of the machine's paths and, with several ranks,
ZeRO-3's collectives (`layers.py`, `grad_error.py`, `machine.py`; the fields and units are in
`data.py`).

`load_or_profile` keeps the result in a JSON file with a fingerprint of what it depends on (model
architecture, run shape, dtype, threads, world size, versions, CPU or GPU model, NVMe folder,
profiler settings), reuses it when the fingerprint matches and measures again, saying which field
differs, when not. A file that is not a lazyzero profile is refused, never overwritten.

With several ranks (the engine profiles inside the launched job) every rank measures the same
things at the same time, the results are combined (the slowest time and bandwidth of any rank)
so that all ranks hold the same profile, and rank 0 writes the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lazyzero._version import __version__ as lazyzero_version
from lazyzero.activations.config import ActivationsConfig
from lazyzero.plan.deepspeed.costs import EMBED_AND_HEAD
from lazyzero.plan.deepspeed.host_memory import compute_memory_bytes
from lazyzero.plan.profile import grad_error as grad_error_
from lazyzero.plan.profile import layers as layers_
from lazyzero.plan.profile import machine as machine_
from lazyzero.plan.profile.data import (
    DECODER,
    EMBED_AND_HEAD_KIND,
    PROFILE_KIND,
    PROFILE_VERSION,
    Fingerprint,
    LayerProfile,
    MachineProfile,
    MemorySnapshot,
    ModelProfile,
)
from lazyzero.plan.profile.engine_calibration import calibrate_engine
from lazyzero.plan.profile.materialize import held_on_compute_device
from lazyzero.plan.solver.problem import BIT_WIDTHS

# Config keys that do not change what a training step computes (labels, special ids, output flags).
VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures", "id2label", "label2id",
    "bos_token_id", "eos_token_id", "pad_token_id", "output_hidden_states", "output_attentions", "return_dict",
    "problem_type", "initializer_range", "_commit_hash"})


@dataclass(frozen=True)
class ProfileSettings:
    """How much to measure. Sizes in bytes, elements for the optimizers; times are medians of
    `repeats` runs after `warmup` untimed ones."""

    repeats: int = 5
    warmup: int = 1
    optimizer_elements: int = 4 * 2**20
    host_copy_bytes: int = 256 * 2**20
    nvme_bytes: int = 256 * 2**20
    device_copy_bytes: int = 256 * 2**20
    measure_memory: bool = True
    seed: int = 0


class ProfileFileError(ValueError):
    """A profile file that cannot be used: not JSON, not a lazyzero profile, or damaged."""


@dataclass(frozen=True)
class _Request:
    """Everything a profile depends on besides the model."""

    micro_batch: int
    seq_len: int
    nvme_path: str | None
    aio: dict
    activations: ActivationsConfig
    settings: ProfileSettings
    device: torch.device
    engine_config: dict | None = None

    def settings_record(self) -> dict:
        return {**dataclasses.asdict(self.settings), "aio": self.aio if self.nvme_path else None,
                "activations": self.activations.model_dump(mode="json"), "engine_config": self.engine_config}


def _request(micro_batch, seq_len, nvme_path, ds_config, activations, settings, device,
             engine_config=None) -> _Request:
    if micro_batch < 1 or seq_len < 1:
        raise ValueError(f"micro_batch and seq_len must be >= 1, got {micro_batch} and {seq_len}")
    nvme = None if nvme_path is None else str(machine_.check_nvme_folder(nvme_path))
    aio = machine_.aio_settings(ds_config) if nvme else {}
    device = torch.device(device) if device is not None else _default_device()
    return _Request(micro_batch, seq_len, nvme, aio, activations or ActivationsConfig(), settings, device,
                    engine_config)


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def model_config_sha256(model: nn.Module) -> str:
    """Hash of the model's architecture: its config without VOLATILE_CONFIG_KEYS, plus the attention
    implementation (which the config's dict leaves out)."""
    config = model.config.to_dict()
    kept = {key: value for key, value in config.items() if key not in VOLATILE_CONFIG_KEYS}
    kept["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    return _sha256(kept)


def model_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def fingerprint(model: nn.Module, request: _Request) -> Fingerprint:
    import deepspeed

    return Fingerprint(
        model_config_sha256=model_config_sha256(model), micro_batch=request.micro_batch, seq_len=request.seq_len,
        dtype=str(model_dtype(model)).removeprefix("torch."), threads=torch.get_num_threads(), world_size=_world()[1],
        torch_version=torch.__version__, deepspeed_version=deepspeed.__version__, lazyzero_version=lazyzero_version,
        device_name=machine_.device_name(request.device), nvme_path=request.nvme_path,
        settings_sha256=_sha256(request.settings_record()))


def memory_snapshot(model: nn.Module) -> MemorySnapshot:
    """The compute memory held (the resident set; on CUDA the device's allocated bytes), and what this
    rank holds of the model there (of a partitioned parameter its partition, of a meta one nothing)."""
    buffers = sum(t.numel() * t.element_size() for t in model.buffers() if not t.is_meta)
    return MemorySnapshot(compute_memory_bytes(), held_on_compute_device(model), buffers)


class _Phases:
    """One progress line per phase on rank 0, and every rank entering each phase together."""

    def __init__(self, names: list[str], show: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=len(names), desc="lazyzero profile", disable=not show, dynamic_ncols=True)

    def start(self, name: str) -> None:
        if _world()[1] > 1:
            torch.distributed.barrier()
        self.bar.set_postfix_str(name)

    def detail(self, text: str) -> None:
        """How far the current phase is (e.g. "grad_error 3/30 layers")."""
        self.bar.set_postfix_str(text)

    def done(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def profile_model(model: nn.Module, *, micro_batch: int, seq_len: int, nvme_path: str | None = None,
                  ds_config: dict | None = None, activations: ActivationsConfig | None = None,
                  settings: ProfileSettings = ProfileSettings(), device: torch.device | str | None = None,
                  progress: bool = True) -> ModelProfile:
    """Measure `model` (a transformers causal LM, left unchanged: whole, partitioned by
    `deepspeed.zero.Init`, or on the meta device) for micro-batches of `micro_batch` x `seq_len` on
    `device` (default: the current CUDA device, else the CPU). The model is measured one decoder layer
    at a time, on whole copies (`materialize.py`): no rank holds the whole model; a partitioned
    model's layers are gathered one by one, so every rank must call this (they all do anyway).

    nvme_path: folder whose aio write/read speed is measured, with `ds_config`'s "aio" section.
    activations: the activation config whose policy the packer uses (default_bits is replaced by
    16, 8 and 4 in turn); default: lazyzero's defaults. Under torch.distributed every rank must call
    this at the same time; all get the same profile.
    """
    request = _request(micro_batch, seq_len, nvme_path, ds_config, activations, settings, device)
    return _measure(model, request, progress)


def _measure(model: nn.Module, request: _Request, progress: bool) -> ModelProfile:
    started = time.perf_counter()
    rank, world = _world()
    memory = memory_snapshot(model)
    phases = _Phases(["layers", "grad_error", "embed_and_head", "optimizers", "bandwidths"]
                     + (["collectives"] if world > 1 else [])
                     + (["engine"] if request.engine_config is not None else []), progress and rank == 0)
    try:
        rows, shared, head_rows = _layer_rows(model, request, phases)
        machine = _machine(model, request, phases, rows)
        engine = _engine(model, request, phases)
    finally:
        phases.close()
    profile = ModelProfile(fingerprint(model, request), tuple(rows + head_rows), shared, machine, memory,
                           request.settings_record(), time.perf_counter() - started, engine)
    return _agree_across_ranks(profile) if world > 1 else profile


def _layer_rows(model: nn.Module, request: _Request, phases: _Phases):
    """Rows for every decoder layer and for embed_and_head, and the bytes every layer's call saves once."""
    decoder = layers_.decoder_layers(model)
    if not decoder:
        raise ValueError(f"{type(model).__name__}: no decoder layers found "
                         "(named like model.layers.N or transformer.h.N)")
    batch = layers_.profiling_batch(request.micro_batch, request.seq_len, model.config.vocab_size,
                                    request.device, request.settings.seed)
    calls = layers_.capture_layer_calls(model, decoder, batch, request.device)
    phases.start("layers")
    measured, shared = _decoder_measurements(model, request, decoder, calls)
    phases.done()
    phases.start("grad_error")
    errors = grad_error_.grad_errors(model, calls, batch, request.activations, request.device, request.settings.seed,
                                     lambda done: phases.detail(f"grad_error {done}/{len(decoder)} layers"))
    phases.done()
    rows = []
    for name in decoder:
        source, values = measured[name]
        rows.append(LayerProfile(name=name, kind=DECODER, measured_as=source, grad_error=errors[name],
                                 tensors=layers_.tensor_table(model, name + "."), **values))
    phases.start("embed_and_head")
    head_row = _head_row(model, request, decoder, calls, batch)
    phases.done()
    return rows, shared, [head_row]


def _decoder_measurements(model: nn.Module, request: _Request, decoder: dict,
                          calls: layers_.ModelCalls) -> tuple[dict, dict]:
    """(layer name -> (the layer measured for it, its measurements), bytes saved once per forward):
    one measurement per distinct layer shape, of the first layer of that shape, called as the model
    calls it."""
    settings, repeats = request.settings, layers_.Repeats(request.settings.repeats, request.settings.warmup)
    by_shape, measured, shared = {}, {}, {}
    for name in decoder:
        shape = _layer_signature(decoder[name], name, layers_.tensor_table(model, name + "."))
        if shape not in by_shape:
            bench = layers_.decoder_bench(model, name, calls.calls[name], request.device, settings.seed)
            offload = None
            if request.nvme_path is not None and machine_.aio_unavailable_reason() is None:
                offload = (layers_.layer_number(name), request.nvme_path)
            values = layers_.measure_layer(bench, repeats, request.activations, True, settings.measure_memory,
                                           offload)
            layer_shared = values.pop("shared_saved_bytes")
            shared = shared or layer_shared  # received by every layer: the first layer's measurement
            by_shape[shape] = (name, values)
        measured[name] = by_shape[shape]
    return measured, shared


def _head_row(model: nn.Module, request: _Request, decoder: dict, calls: layers_.ModelCalls,
              batch: dict) -> LayerProfile:
    settings, device = request.settings, request.device
    returns_tuple = next(iter(calls.calls.values())).returns_tuple
    head = layers_.head_bench(model, list(decoder), returns_tuple, _to(batch, device), device, settings.seed)
    values = layers_.measure_layer(head, layers_.Repeats(settings.repeats, settings.warmup), request.activations,
                                   False, settings.measure_memory)
    values.pop("shared_saved_bytes")
    # Never packed (the planner gives it the same bytes at every width): no error to measure.
    return LayerProfile(name=EMBED_AND_HEAD, kind=EMBED_AND_HEAD_KIND, measured_as=EMBED_AND_HEAD,
                        tensors=layers_.tensor_table(model, "", skip=tuple(decoder)),
                        grad_error=dict.fromkeys(BIT_WIDTHS, 0.0), **values)


def _layer_signature(layer: nn.Module, name: str, tensors: dict) -> tuple:
    """Layers with the same class and parameter shapes cost the same."""
    return (type(layer).__name__, tuple((key[len(name):], info.numel, info.dtype) for key, info in tensors.items()))


def _to(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def _machine(model: nn.Module, request: _Request, phases: _Phases, rows: list[LayerProfile]) -> MachineProfile:
    settings, device = request.settings, request.device
    repeats, warmup = settings.repeats, settings.warmup
    phases.start("optimizers")
    optimizers, skipped = machine_.optimizer_speeds(settings.optimizer_elements, repeats, warmup, device, settings.seed)
    phases.done()
    phases.start("bandwidths")
    bandwidths = {"host_copy": machine_.host_copy(settings.host_copy_bytes, repeats, warmup)}
    if device.type == "cuda":
        bandwidths.update(machine_.device_copies(device, settings.device_copy_bytes, repeats, warmup))
    else:
        skipped["h2d/d2h"] = "no CUDA device: compute runs in host memory"
    nvme = None
    if request.nvme_path is None:
        skipped["nvme"] = "no nvme path given"
    elif (reason := machine_.aio_unavailable_reason()) is not None:
        skipped["nvme"] = reason
    else:
        nvme_speeds, nvme = machine_.nvme_bandwidths(request.nvme_path, settings.nvme_bytes, request.aio, repeats,
                                                     warmup)
        bandwidths.update(nvme_speeds)
    phases.done()
    collectives = {}
    if _world()[1] > 1:
        phases.start("collectives")
        collectives = machine_.collective_speeds(rows[0].param_numel, model_dtype(model), device, repeats, warmup)
        phases.done()
    else:
        skipped["collectives"] = "world size 1"
    return MachineProfile(device.type, machine_.device_name(device), torch.get_num_threads(),
                          _host_memory_bytes(), bandwidths, nvme, optimizers, collectives, skipped)


def _engine(model: nn.Module, request: _Request, phases: _Phases):
    """Engines of the model cut to a few layers under the calibration config (profile_engine.py)."""
    if request.engine_config is None:
        return None

    phases.start("engine")
    batch = layers_.profiling_batch(request.micro_batch, request.seq_len, model.config.vocab_size,
                                    request.device, request.settings.seed)
    calibration = calibrate_engine(model, request.engine_config, batch, request.settings.repeats)
    phases.done()
    return calibration


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _agree_across_ranks(profile: ModelProfile) -> ModelProfile:
    """Every rank's profile combined into one, the same on every rank (see `combine`)."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, profile)
    return combine(gathered)


def combine(profiles: list, field: str = ""):
    """Combine the ranks' values of one field: bandwidths (`bytes_per_s`) by their minimum, every
    other number by its maximum (the slowest rank sets the pace; bytes agree or, like RSS, the
    largest counts); anything else (names, versions) as rank 0 has it."""
    first = profiles[0]
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **{f.name: combine([getattr(p, f.name) for p in profiles], f.name)
                                             for f in dataclasses.fields(first)})
    if isinstance(first, dict):
        return {key: combine([p[key] for p in profiles if key in p], field) for key in first}
    if isinstance(first, tuple):
        return tuple(combine([p[i] for p in profiles], field) for i in range(len(first)))
    if isinstance(first, (int, float)) and not isinstance(first, bool) and all(p is not None for p in profiles):
        return min(profiles) if field.endswith("bytes_per_s") else max(profiles)
    return first


def read_profile(path: str | os.PathLike) -> ModelProfile:
    """The profile in `path`; ProfileFileError naming the file when it is not one (or damaged)."""
    text = _read_text(path)
    try:
        return ModelProfile.from_json(text)
    except (ValueError, TypeError, KeyError) as error:
        raise ProfileFileError(f"{path}: damaged lazyzero profile ({error}); delete it to profile again") from None


def _read_text(path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ProfileFileError(f"{path}: cannot be read as a lazyzero profile ({error})") from None


def _parsed_header(path, text: str) -> dict:
    """The file's JSON object if it is a lazyzero profile, else ProfileFileError."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileFileError(f"{path}: not a lazyzero profile (not JSON: {error}); "
                               "refusing to overwrite it") from None
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
        raise ProfileFileError(f"{path}: not a lazyzero profile (no \"kind\": \"{PROFILE_KIND}\"); "
                               "refusing to overwrite it")
    return data


def cached_profile(path: str | os.PathLike, expected: Fingerprint) -> tuple[ModelProfile | None, str]:
    """(the profile in `path`, "") when it exists and matches `expected`; (None, why not) when it is
    absent, of another version or fingerprint. ProfileFileError when it is foreign or damaged."""
    if not Path(path).exists():
        return None, "no profile yet"
    text = _read_text(path)
    version = _parsed_header(path, text).get("version")
    if version != PROFILE_VERSION:
        return None, f"profile version {version!r} in the file, {PROFILE_VERSION} now"
    profile = read_profile(path)
    differences = profile.fingerprint.differences(expected)
    return (None, "; ".join(differences)) if differences else (profile, "")


def write_profile(path: str | os.PathLike, profile: ModelProfile) -> None:
    """Write atomically: a temporary file beside `path`, flushed, then renamed over it."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(profile.to_json())
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load_or_profile(path: str | os.PathLike, model: nn.Module, *, micro_batch: int, seq_len: int,
                    nvme_path: str | None = None, ds_config: dict | None = None,
                    activations: ActivationsConfig | None = None, settings: ProfileSettings = ProfileSettings(),
                    device: torch.device | str | None = None, progress: bool = True, log=print,
                    engine_config: dict | None = None) -> ModelProfile:
    """The profile cached in `path` if its fingerprint matches this model, run and machine; else a
    new one (see `profile_model`), written to `path` by rank 0. `log` gets one line saying why a
    profile is measured. Raises ProfileFileError (on every rank) if `path` is not a lazyzero profile.
    `engine_config`: a DeepSpeed config to calibrate real engines with (profile_engine.py), or None."""
    request = _request(micro_batch, seq_len, nvme_path, ds_config, activations, settings, device, engine_config)
    rank, world = _world()
    verdict = _cache_verdict(path, fingerprint(model, request)) if rank == 0 else None
    if world > 1:
        shared = [verdict]
        torch.distributed.broadcast_object_list(shared, src=0)
        verdict = shared[0]
    cached_json, reason, error = verdict
    if error:
        raise ProfileFileError(error)
    if cached_json is not None:
        return ModelProfile.from_json(cached_json)
    if rank == 0:
        log(f"lazyzero profile: measuring {path} ({reason})")
    profile = _measure(model, request, progress)
    if rank == 0:
        write_profile(path, profile)
    if world > 1:
        torch.distributed.barrier()
    return profile


def _cache_verdict(path, expected: Fingerprint) -> tuple[str | None, str, str]:
    """(cached profile as JSON or None, why it is not used, error) on rank 0, for broadcasting."""
    try:
        profile, reason = cached_profile(path, expected)
    except ProfileFileError as error:
        return None, "", str(error)
    return (profile.to_json() if profile else None), reason, ""
