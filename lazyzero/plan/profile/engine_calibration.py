"""Engine calibration in the planner's profile (docs/plan.md): what DeepSpeed itself costs around the layers.

The per-layer measurements of `profile_layers.py` time a layer alone. A ZeRO-3 engine adds its own
work around every layer (parameter gathers and releases through its module hooks, gradient
buckets, copies into partitions, the fp32 master update) and around every step, and memory of its
own (buckets, flat buffers, the allocator's slack). Measured on this machine for a 103M-parameter
bf16 Llama on 2 ranks: 3.64 s per step in memory against 2.6 s from the layers, collectives and
optimizer alone. Those costs are real and must be in the prediction, so they are measured the only
way that includes them: real engines of the same model cut to 1 and to 3 decoder layers, built with
the run's ZeRO settings (everything in memory), a few steps each. `calibrate.engine_calibrated`
turns the difference between the two into a per-layer overhead and the rest into a per-step one.

Each engine runs in a fresh child process per rank, with a process group of its own: a DeepSpeed
engine does not give its memory back when destroyed (330 MB per pair of 1- and 2-layer engines here,
three pairs in a row measured), so the planned run must not start with that garbage in its budget,
and a second engine in the same process would reuse it and look smaller than it is (the demo preset's
3-layer engine: 316 MB alone, 249 MB after the 1-layer one).

    python -m lazyzero.plan.profile.engine_calibration REQUEST.json   (what each rank's child runs)
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from lazyzero.plan.profile.data import EngineCalibration, EngineRun

# Two depths a few layers apart: the slope between them is DeepSpeed's cost per layer.
CALIBRATION_LAYERS = (1, 3)
WARMUP_STEPS = 1
CHILD_TIMEOUT_S = 1800


def calibrate_engine(model: nn.Module, config: dict, batch: dict, steps: int) -> EngineCalibration:
    """Step time and peak resident set of real engines of `model` cut to CALIBRATION_LAYERS decoder
    layers, under DeepSpeed `config`, each in fresh processes (every rank calls this together; `batch`
    is one micro-batch)."""
    rank, world = _world()
    with tempfile.TemporaryDirectory(prefix="lazyzero-calibration-") as folder:
        model.config.save_pretrained(folder)
        request = {"config_dir": folder, "ds_config": config, "dtype": str(_dtype(model)).removeprefix("torch."),
                   "attn_implementation": getattr(model.config, "_attn_implementation", None),
                   "batch": {key: value.tolist() for key, value in batch.items()}, "steps": steps,
                   "rank": rank, "world_size": world, "threads": torch.get_num_threads()}
        runs = tuple(_run_in_child(request, layers, Path(folder)) for layers in CALIBRATION_LAYERS)
    return EngineCalibration(runs=runs, config=config)


def _run_in_child(request: dict, layers: int, folder: Path) -> EngineRun:
    """The engine of `layers` decoder layers, run by this rank's fresh child process."""
    rank = request["rank"]
    request_path, result_path = folder / f"request{rank}-{layers}.json", folder / f"result{rank}-{layers}.json"
    request = {**request, "layers": layers, "port": _shared_port(), "result_path": str(result_path)}
    request_path.write_text(json.dumps(request))
    child = subprocess.run([sys.executable, "-m", "lazyzero.plan.profile.engine_calibration", str(request_path)],
                           env=_child_env(request), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=CHILD_TIMEOUT_S)
    if child.returncode != 0 or not result_path.is_file():
        raise RuntimeError(f"lazyzero profile: the engine calibration ({layers} decoder layers) failed on rank "
                           f"{rank} (exit {child.returncode}):\n{child.stdout[-3000:]}")
    return EngineRun(**json.loads(result_path.read_text()))


def _world() -> tuple[int, int]:
    dist = torch.distributed
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def _dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _shared_port() -> int:
    """A port free on rank 0's host, for the children's rendezvous, the same on every rank."""
    from lazyzero.distributed.launch import free_port

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


def _run(model: nn.Module, config: dict, batch: dict, steps: int, layers: int) -> dict:
    import deepspeed

    from lazyzero.plan.host_memory import peak_resident_bytes, reset_peak_resident, resident_bytes
    from lazyzero.plan.zero_placement import ZeroPlacement, zero_placement

    before = resident_bytes()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    offload = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme"
    # As a planned run does: optimizer offload to NVMe with every layer kept in memory.
    with zero_placement(ZeroPlacement()) if offload else nullcontext():
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ends = []
    for step in range(WARMUP_STEPS + steps):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        ends.append(time.perf_counter())
        if step + 1 == WARMUP_STEPS:
            reset_peak_resident()
    peak = peak_resident_bytes()
    durations = [b - a for a, b in zip(ends[WARMUP_STEPS - 1:], ends[WARMUP_STEPS:])]
    torch.distributed.barrier()
    engine.destroy()
    return {"layers": layers, "step_s": statistics.median(durations), "peak_bytes": peak, "before_bytes": before,
            "model_bytes": model_bytes}


def _child(request_path: str) -> None:
    """One rank's child: the calibration engine of `request["layers"]` decoder layers, alone in this
    fresh process."""
    import deepspeed
    from deepspeed import comm

    from lazyzero.distributed.shm_segments import release_own_segment_name
    from lazyzero.plan.host_memory import bound_host_heap

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
    run = _run(model, request["ds_config"], batch, request["steps"], layers)
    Path(request["result_path"]).write_text(json.dumps(run))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _child(sys.argv[1])
