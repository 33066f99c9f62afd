"""The planner's profile of a model no rank holds whole (bench_planner.py, docs/plan.md "Planning
partitioned models"): one rank of a job that builds the benchmark's model partitioned across the
ranks as it is created, then profiles it as a planned run does (the same copy-test sizes), and
records how far the resident set rose while profiling.

Usage (under the deepspeed launcher): planner_profile_worker.py MODEL.json OUT.json SEQ_LEN MICRO_BATCH
OUT.json (rank 0): the whole model's parameter bytes, the resident set before profiling and its peak
during it, per rank, the peak of each profiling phase (the model's layers, or fixed-size machine
tests), and the profile's seconds.
"""

import json
import sys
import time

import deepspeed
import torch

from lazyzero.models import build_model
from lazyzero.plan.deepspeed.engine_setup import PROFILE_COPY_BYTES
from lazyzero.plan.deepspeed.host_memory import (
    bound_host_heap,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)
from lazyzero.plan.profile import profiler
from lazyzero.plan.profile.materialize import full_numel
from lazyzero.plan.profile.profiler import ProfileSettings, profile_model
from lazyzero.testing import worker_args


def phase_peaks(before: int) -> dict:
    """Phase name -> rise of the resident set's peak over `before` in that phase, filled in as the
    profiler enters each phase (its progress hook, `_Phases.start`)."""
    # Before the first phase: the replay of the model's forward that records each layer's arguments.
    peaks, current = {}, ["replay"]
    start = profiler._Phases.start

    def start_and_record(phases, name):
        peaks[current[0]] = peak_resident_bytes() - before
        reset_peak_resident()
        current[0] = name
        return start(phases, name)

    def close(phases):
        peaks[current[0]] = peak_resident_bytes() - before
        phases.bar.close()

    profiler._Phases.start, profiler._Phases.close = start_and_record, close
    return peaks


def main() -> None:
    model_path, out, seq_len, micro_batch = worker_args()
    bound_host_heap()  # as a planned run profiles (lazyzero/plan/deepspeed/engine_setup.py)
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": int(micro_batch), "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3}}
    model = build_model(model_path, dtype=torch.bfloat16, zero_init_config=config)
    model_bytes = sum(full_numel(p) * p.element_size() for p in model.parameters())
    before = resident_bytes()
    reset_peak_resident()
    peaks = phase_peaks(before)
    started = time.perf_counter()
    # With the copy-test sizes a planned run profiles with: the profiler's own buffers are the same
    # for any model, and the default 256 MiB ones would be most of what this measures.
    size = PROFILE_COPY_BYTES
    settings = ProfileSettings(host_copy_bytes=size, nvme_bytes=size, device_copy_bytes=size)
    profile_model(model, micro_batch=int(micro_batch), seq_len=int(seq_len), settings=settings, progress=False)
    seconds = time.perf_counter() - started
    gathered = [None] * torch.distributed.get_world_size()
    record = {"before_bytes": before, "peak_bytes": before + max(peaks.values()), "phase_rise_bytes": peaks}
    torch.distributed.all_gather_object(gathered, record)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as file:
            json.dump({"model_bytes": model_bytes, "ranks": gathered, "profile_s": seconds}, file)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
