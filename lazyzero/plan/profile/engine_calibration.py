"""Engine calibration in the planner's profile: what DeepSpeed itself costs around the layers
(docs/plan.md, "The calibration engines").

The per-layer measurements of `layers.py` time a layer alone. A ZeRO-3 engine adds its own work around
every layer (parameter gathers and releases through its module hooks, gradient buckets, copies into
partitions, the fp32 master update) and around every step, and memory of its own (buckets, flat
buffers, the allocator's slack). Those costs must be in the prediction, so they are measured the only
way that includes them: real engines of the same model cut to 1 and to 3 decoder layers, built with
the run's ZeRO settings (everything in memory), a few steps each. `calibrate.engine_calibrated` turns
the line through the shallowest and the deepest engine into a per-layer and a per-step overhead.

On the host (no GPU), a model held whole on every rank with more decoder layers than the second engine
is also run at its own depth (at most DEEPEST_CALIBRATION_LAYERS) where the line through the first two
engines' peaks says it fits the memory the host has free: DeepSpeed's cost per layer grows with depth
under the planned runs' allocator bound (`plan/deepspeed/host_memory.py`). A model partitioned at construction or on
the meta device is taken not to fit whole and keeps the two shallow engines.

Where the run may swap to NVMe (its optimizer is offloaded there), one more engine of 3 decoder layers
has every decoder layer's parameters and optimizer state on NVMe, as a plan that puts layers there runs
them, and what it adds over the in-memory engine of its depth prices the plan's NVMe traffic
(`calibrate.nvme_calibrated`); the profile's disk test does not follow what a run's swaps take. Where
parameters may go to NVMe, another has only the decoder layers' parameters there: DeepSpeed reads them
a tensor at a time before each use, so they are priced at their own speed.

Each engine runs in a fresh child process per rank, with a process group of its own: a DeepSpeed
engine does not give its memory back when destroyed, so the planned run must not start with that
garbage in its budget, and a second engine in the same process would reuse it and look smaller than it
is. The measurements behind these rules: benchmarks/results/records/2026-12-02-planner-calibration-notes.md.

    python -m lazyzero.plan.profile.engine_calibration REQUEST.json   (what each rank's child runs)
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import psutil
import torch
from torch import nn

from lazyzero.distributed.launch import free_port
from lazyzero.distributed.shm_segments import release_own_segment_name
from lazyzero.gradients.node_layout import launcher_ranks_per_node
from lazyzero.plan.deepspeed.host_memory import (
    bound_host_heap,
    compute_memory_bytes,
    compute_peak_bytes,
    reset_compute_peak,
)
from lazyzero.plan.deepspeed.implied import nvme_calibration_ds_config
from lazyzero.plan.deepspeed.problem_from_profile import nvme_swaps_parameters
from lazyzero.plan.profile.data import EngineCalibration, EngineRun
from lazyzero.plan.profile.materialize import held_on_compute_device, holds_whole_model

logger = logging.getLogger(__name__)

# Two depths a few layers apart: the slope between them is DeepSpeed's cost per layer.
CALIBRATION_LAYERS = (1, 3)
NVME_CALIBRATION_LAYERS = CALIBRATION_LAYERS[-1]
# The deepest engine of a model held whole: its profile time stays within about six training steps of
# a 12-layer model (the demo preset has 6 layers, bench_planner's model 8).
DEEPEST_CALIBRATION_LAYERS = 12
# The NVMe engine times this many times the steps of the others: a disk's speed wanders from step to
# step more than compute does (benchmarks/results/records/2026-12-02-planner-calibration-notes.md).
NVME_STEPS_FACTOR = 2
WARMUP_STEPS = 1
CHILD_TIMEOUT_S = 1800
# A child killed by a signal before writing its result is run once more (with its peers): a ZeRO-3
# engine's teardown under gloo aborted a process with "terminate called without an active
# exception" once in several runs (lazyzero.testing.destroy_engine; once in the README job's
# profile with torch 2.14.1+cu130). A child that fails with an exit status fails the profile.
SIGNAL_RETRIES = 1
# Test hook: LAZYZERO_CALIBRATION_ABORT=MARKER@RANK makes that rank's child abort before writing its
# result while the file MARKER does not exist, creating it first (so once).
ABORT_ONCE_ENV = "LAZYZERO_CALIBRATION_ABORT"
# What an NVMe engine swaps: its decoder layers' parameters and optimizer state, or parameters only.
NVME_ALL, NVME_PARAMS = "nvme", "nvme-params"


def calibrate_engine(model: nn.Module, config: dict, batch: dict, steps: int) -> EngineCalibration:
    """Step time and peak resident set of real engines of `model` cut to CALIBRATION_LAYERS decoder
    layers, and where it applies to the model's own depth (`own_depth_engine_layers`), under DeepSpeed
    `config`, each in fresh processes (every rank calls this together; `batch` is one micro-batch)."""
    rank, world = _world()
    swapped_depths = []
    if swaps_to_nvme(config):
        swapped_depths.append((NVME_CALIBRATION_LAYERS, NVME_ALL))
        if parameters_swappable(model):
            swapped_depths.append((NVME_CALIBRATION_LAYERS, NVME_PARAMS))
    with tempfile.TemporaryDirectory(prefix="lazyzero-calibration-") as folder:
        model.config.save_pretrained(folder)
        request = {"config_dir": folder, "ds_config": config, "dtype": str(_dtype(model)).removeprefix("torch."),
                   "attn_implementation": getattr(model.config, "_attn_implementation", None),
                   "batch": {key: value.tolist() for key, value in batch.items()}, "steps": steps,
                   "rank": rank, "world_size": world, "threads": torch.get_num_threads()}
        runs = [_run_in_child(request, layers, Path(folder), "") for layers in CALIBRATION_LAYERS]
        deepest = own_depth_engine_layers(model, runs)
        if deepest is not None:
            runs.append(_run_in_child(request, deepest, Path(folder), ""))
        runs += [_run_in_child(request, layers, Path(folder), swapped) for layers, swapped in swapped_depths]
    return EngineCalibration(runs=tuple(runs), config=config)


def own_depth_engine_layers(model: nn.Module, shallow: list[EngineRun]) -> int | None:
    """The depth of the engine run at the model's own depth (see the module's notes), or None; the same
    on every rank (every rank calls this together)."""
    from lazyzero.plan.profile.layers import decoder_layers

    if torch.cuda.is_available() or not holds_whole_model(model):
        return None
    depth = min(len(decoder_layers(model)), DEEPEST_CALIBRATION_LAYERS)
    if depth <= CALIBRATION_LAYERS[-1]:
        return None
    fits = torch.tensor([float(_line_peak(shallow, depth) <= _free_host_bytes_per_rank())])
    if _world()[1] > 1:
        torch.distributed.all_reduce(fits, op=torch.distributed.ReduceOp.MIN)
    return depth if fits.item() == 1.0 else None


def _line_peak(shallow: list[EngineRun], layers: int) -> float:
    """The resident peak of an engine of `layers` decoder layers on the line through the shallow ones."""
    small, large = shallow[0], shallow[-1]
    per_layer = (large.peak_bytes - small.peak_bytes) / (large.layers - small.layers)
    return large.peak_bytes + max(0.0, per_layer) * (layers - large.layers)


def _free_host_bytes_per_rank() -> float:
    """The host memory available now, shared by the ranks of this host (their engines run at once)."""
    return psutil.virtual_memory().available / (launcher_ranks_per_node() or _world()[1])


def swaps_to_nvme(config: dict) -> bool:
    """Whether a run under this calibration config may swap to NVMe (its optimizer is offloaded there)."""
    return config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme"


def _run_in_child(request: dict, layers: int, folder: Path, swapped: str) -> EngineRun:
    """The engine of `layers` decoder layers (`swapped`: "", NVME_ALL or NVME_PARAMS), run by this rank's
    fresh child process; every rank's children once more when one was killed by a signal (below)."""
    rank, name = request["rank"], f"{layers}{'-' + swapped if swapped else ''}"
    request_path, result_path = folder / f"request{rank}-{name}.json", folder / f"result{rank}-{name}.json"
    for attempt in range(1 + SIGNAL_RETRIES):
        result_path.unlink(missing_ok=True)
        request = {**request, "layers": layers, "nvme": bool(swapped), "params_only": swapped == NVME_PARAMS,
                   "port": _shared_port(), "result_path": str(result_path)}
        request_path.write_text(json.dumps(request))
        child = subprocess.run([sys.executable, "-m", "lazyzero.plan.profile.engine_calibration", str(request_path)],
                               env=_child_env(request), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=CHILD_TIMEOUT_S)
        outcome = _every_ranks_outcome(child.returncode, result_path.is_file())
        if outcome == _DONE:
            if child.returncode != 0:
                logger.warning("lazyzero profile: the engine calibration (%s decoder layers) died with exit %s on "
                               "rank %s after writing its result; the result is used", name, child.returncode, rank)
            return EngineRun(**json.loads(result_path.read_text()))
        if outcome == _KILLED and attempt < SIGNAL_RETRIES:
            logger.warning("lazyzero profile: the engine calibration (%s decoder layers) was killed by a signal on "
                           "a rank (here: exit %s); running it once more on every rank", name, child.returncode)
            continue
        break
    raise RuntimeError(f"lazyzero profile: the engine calibration ({name} decoder layers) failed on rank "
                       f"{rank} (exit {child.returncode}; 0 here means another rank's failed):\n"
                       f"{child.stdout[-3000:]}")


_DONE, _FAILED, _KILLED = 0, 1, 2


def _every_ranks_outcome(returncode: int, result_written: bool) -> int:
    """The worst outcome over the ranks' children: _DONE (every result written), _FAILED, or _KILLED
    (some child died by a signal before its result). Every rank must take the same branch: the
    children of one attempt rendezvous with each other, so a rank that retried alone would wait."""
    outcome = _DONE if result_written else (_KILLED if returncode < 0 else _FAILED)
    if _world()[1] > 1:
        worst = torch.tensor([outcome])
        torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
        outcome = int(worst.item())
    return outcome


def _world() -> tuple[int, int]:
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def _dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _shared_port() -> int:
    """A port free on rank 0's host, for the children's rendezvous, the same on every rank."""
    port = [free_port() if _world()[0] == 0 else None]
    if _world()[1] > 1:
        torch.distributed.broadcast_object_list(port, src=0)
    return port[0]


def _child_env(request: dict) -> dict:
    env = dict(os.environ)
    env.update(MASTER_ADDR=env.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(request["port"]),
               RANK=str(request["rank"]), WORLD_SIZE=str(request["world_size"]),
               LOCAL_RANK=env.get("LOCAL_RANK", "0"), OMP_NUM_THREADS=str(request["threads"]))
    return env


def _truncated(config_dir: str, layers: int, dtype: torch.dtype, attn_implementation: str | None) -> nn.Module:
    """A fresh model of the architecture in `config_dir` with only `layers` decoder layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = copy.deepcopy(AutoConfig.from_pretrained(config_dir))
    config.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)


def _placement(model: nn.Module, config: dict, nvme: bool, params_only: bool = False):
    """As a planned run places them: with `nvme` every decoder layer's parameters and optimizer
    state on NVMe (with `params_only`, parameters only; the embeddings and head in memory), else, with
    the optimizer offloaded to NVMe, every layer kept in memory; None where nothing is offloaded."""
    from lazyzero.plan.deepspeed.zero_placement import ZeroPlacement
    from lazyzero.plan.profile.layers import decoder_layers

    if nvme:
        layers = list(decoder_layers(model))
        return ZeroPlacement.from_modules([name for name, _ in model.named_parameters()],
                                          [] if params_only else layers,
                                          layers if parameters_swappable(model) else None)
    return ZeroPlacement() if swaps_to_nvme(config) else None


def parameters_swappable(model: nn.Module) -> bool:
    """Whether a planned run may put this model's parameters on NVMe (the planner's own rule)."""
    return nvme_swaps_parameters(str(_dtype(model)).removeprefix("torch."), on_gpu=torch.cuda.is_available())


def _run(model: nn.Module, config: dict, batch: dict, steps: int, layers: int, nvme: bool = False,
         params_only: bool = False) -> dict:
    import deepspeed

    from lazyzero.plan.deepspeed.zero_placement import zero_placement

    # The memory training computes in (the device's on CUDA, where the model given is still on the host
    # and takes none of it before DeepSpeed moves it).
    before = compute_memory_bytes()
    model_bytes = held_on_compute_device(model)
    placement = _placement(model, config, nvme, params_only)
    with zero_placement(placement) if placement is not None else nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ends = []
    for step in range(WARMUP_STEPS + steps):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        ends.append(time.perf_counter())
        if step + 1 == WARMUP_STEPS:
            reset_compute_peak()
    peak = compute_peak_bytes()
    durations = [b - a for a, b in zip(ends[WARMUP_STEPS - 1:], ends[WARMUP_STEPS:])]
    torch.distributed.barrier()
    engine.destroy()
    return {"layers": layers, "step_s": statistics.median(durations), "peak_bytes": peak, "before_bytes": before,
            "model_bytes": model_bytes, "nvme": nvme, "params_only": params_only}


def _child(request_path: str) -> None:
    """One rank's child: the calibration engine of `request["layers"]` decoder layers, alone in this
    fresh process."""
    import deepspeed
    from deepspeed import comm

    request = json.loads(Path(request_path).read_text())
    bound_host_heap()
    torch.set_num_threads(request["threads"])
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    release_own_segment_name(comm)
    dtype = getattr(torch, request["dtype"])
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    batch = {key: torch.tensor(value, device=device) for key, value in request["batch"].items()}
    layers = request["layers"]
    model = _truncated(request["config_dir"], layers, dtype, request["attn_implementation"])
    with _swap_folder(request) as folder:
        config = request["ds_config"]
        if folder is not None:
            from lazyzero.plan.profile.layers import model_sizes_of

            config = nvme_calibration_ds_config(config, model_sizes_of(model, request["world_size"]), str(folder),
                                                parameters=parameters_swappable(model))
        steps = request["steps"] * (NVME_STEPS_FACTOR if request["nvme"] else 1)
        run = _run(model, config, batch, steps, layers, request["nvme"], request["params_only"])
    _abort_once_if_asked(request["rank"])
    Path(request["result_path"]).write_text(json.dumps(run))
    torch.distributed.destroy_process_group()


def _abort_once_if_asked(rank: int) -> None:
    spec = os.environ.get(ABORT_ONCE_ENV)
    if not spec:
        return
    marker, target = spec.rsplit("@", 1)
    if int(target) == rank and not os.path.exists(marker):
        Path(marker).touch()
        os.abort()


@contextmanager
def _swap_folder(request: dict):
    """For the NVMe engine, a folder of this rank's own in the run's NVMe folder, removed afterwards:
    DeepSpeed never removes its swap files, and the run's own would be named alike."""
    if not request["nvme"]:
        yield None
        return
    nvme_path = request["ds_config"]["zero_optimization"]["offload_optimizer"]["nvme_path"]
    folder = Path(tempfile.mkdtemp(prefix=f"lazyzero-calibration-rank{request['rank']}-", dir=nvme_path))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    _child(sys.argv[1])
