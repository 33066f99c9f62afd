"""Int8 gradient reduce-scatter against fp32, bf16 and DeepSpeed's ZeRO-3 reduction (docs/gradients.md).

One run starts 4 ranks on gloo (CPU, 1 thread each; fresh ranks for each phase, see `run_phase`)
and, for gradient buckets of 4, 16 and 64 MiB of fp32, times ways of leaving each rank with its
averaged quarter of the bucket:

- int8: `lazyzero.gradients.quantized_reduce_scatter` (block 256, round to nearest), one reused
  `ExchangeBuffers` as in the engine;
- fp32: `torch.distributed.reduce_scatter_tensor` (gloo has it in torch 2.13), then / W;
- bf16: the same on a bf16 copy, back to fp32, with both conversions timed;
- deepspeed: `deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced`, the call
  ZeRO-3 reduces gradients with (pre-divide by W, then `reduce_scatter_tensor` via deepspeed.comm);
- fp32_all_to_all (context, no target): the int8 algorithm without quantization, fp32 rows by
  `all_to_all_single` and a local sum. It tells apart what int8 gains by sending 4x fewer bytes
  from what it gains by not using gloo's reduce-scatter.

It also splits the int8 exchange at 64 MiB into its stages (quantize, the two all-to-alls,
dequantize-sum), and times a ZeRO-3 training step of the demo model with
ds_configs/cpu_demo_int8.json against ds_configs/cpu_demo.json.

Times are rank 0's medians. Every rank runs the same collectives in the same order, and a
reduce-scatter cannot finish on any rank before the last one has entered it, so rank 0's clock
already contains the wait for stragglers: it is the time a training step loses at that point.
Wire bytes are what one rank sends in a direct exchange (int8: codes and scales of the W - 1
rows it does not own; fp32: W - 1 chunks of 4-byte values), not what gloo's algorithm moves.

    python benchmarks/bench_grad_comm.py --quick --out /tmp/bench_grad_comm.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import median_seconds, parse_args, pin_threads, write_results  # noqa: E402

from lazyzero.distributed.shm_segments import remove_leftover_segments  # noqa: E402
from lazyzero.gradients import ExchangeBuffers, quantized_reduce_scatter  # noqa: E402
from lazyzero.gradients.quantized_reduce_scatter import make_plan  # noqa: E402
from lazyzero.ops import native_build  # noqa: E402
from lazyzero.ops.quant import dequantize_sum_int8  # noqa: E402
from lazyzero.testing import destroy_engine, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 4
THREADS_PER_RANK = 1  # 4 ranks share the 2 cores of the reference machine
BUCKET_MIB = (4, 16, 64)
HEADLINE_MIB = 64
BLOCK_SIZE = 256
MASTER_ADDR = "127.0.0.1"
BASELINE_PRIMITIVE = "torch.distributed.reduce_scatter_tensor (gloo)"
STEP_CONFIGS = {"fp32": "cpu_demo.json", "int8": "cpu_demo_int8.json"}
STEP_BATCH_SHAPE = (4, 192)
DEMO_VOCAB_SIZE = 259


def bucket_cases(flat: torch.Tensor, buffers: ExchangeBuffers) -> tuple[dict, torch.Tensor]:
    """The reductions compared on `flat`, each leaving this rank's averaged chunk in fp32, and the
    tensor the fp32 case writes its chunk to."""
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    chunk = flat.numel() // WORLD_SIZE
    fp32_out = torch.empty(chunk)
    bf16_in = torch.empty(flat.numel(), dtype=torch.bfloat16)
    bf16_out = torch.empty(chunk, dtype=torch.bfloat16)
    bf16_result = torch.empty(chunk)
    # reduce_scatter_coalesced divides its input by W in place, so it gets its own copy. The values
    # shrink by 4x a call; a full run makes under 30 calls, far from fp32's subnormals (2**-126),
    # which would slow the division down.
    deepspeed_in = flat.clone()
    all_to_all_received = torch.empty_like(flat)
    all_to_all_result = torch.empty(chunk)

    def fp32() -> None:
        dist.reduce_scatter_tensor(fp32_out, flat)
        fp32_out.div_(WORLD_SIZE)

    def bf16() -> None:
        bf16_in.copy_(flat)
        dist.reduce_scatter_tensor(bf16_out, bf16_in)
        bf16_result.copy_(bf16_out).div_(WORLD_SIZE)

    def fp32_all_to_all() -> None:
        dist.all_to_all_single(all_to_all_received, flat)
        torch.sum(all_to_all_received.view(WORLD_SIZE, chunk), dim=0, out=all_to_all_result)
        all_to_all_result.div_(WORLD_SIZE)

    cases = {
        "int8": lambda: quantized_reduce_scatter(
            flat, None, block_size=BLOCK_SIZE, stochastic=False, seed=0, average=True,
            buffers=buffers,
        ),
        "fp32": fp32,
        "bf16": bf16,
        "deepspeed": lambda: reduce_scatter_coalesced([deepspeed_in], None),
        "fp32_all_to_all": fp32_all_to_all,
    }
    return cases, fp32_out


def measure_bucket(mib: int, repeats: int) -> dict:
    """Seconds of each reduction of one bucket, wire bytes, and the int8 result's error."""
    numel = mib * 2**20 // 4
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    buffers = ExchangeBuffers()
    cases, fp32_out = bucket_cases(flat, buffers)
    seconds = median_seconds(cases, repeats)
    result = quantized_reduce_scatter(flat, None, block_size=BLOCK_SIZE, buffers=buffers)
    cases["fp32"]()
    # A sanity check that the timed int8 path computes the same average, not a figure of merit.
    relative_error = (result.output - fp32_out).norm() / fp32_out.norm()
    return {
        "seconds": seconds,
        "wire_bytes": {"int8": result.wire_bytes, "fp32": result.fp32_wire_bytes,
                       "bf16": result.fp32_wire_bytes // 2, "deepspeed": result.fp32_wire_bytes,
                       "fp32_all_to_all": result.fp32_wire_bytes},
        "int8_relative_error_vs_fp32": relative_error.item(),
    }


def profile_int8_stages(mib: int, repeats: int) -> dict[str, float]:
    """Seconds of each stage of the int8 exchange, run one after the other as `_exchange` does
    (the all-to-alls waited for at once here, so that their time is theirs alone)."""
    numel = mib * 2**20 // 4
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(dist.get_rank()))
    plan = make_plan(numel, None, None, BLOCK_SIZE, stochastic=False, seed=0, average=True)
    buffers = ExchangeBuffers()
    sent = plan.quantize(flat, phase=0, buffers=buffers)
    received_codes = torch.empty_like(sent.codes)
    received_scales = torch.empty(plan.world_size, plan.blocks_per_row)
    row = torch.empty(plan.row_length)

    def all_to_all() -> None:
        dist.all_to_all_single(received_codes, sent.codes)
        dist.all_to_all_single(received_scales.view(-1), sent.scales)

    stages = {
        "quantize": lambda: plan.quantize(flat, phase=0, buffers=buffers),
        "all_to_all": all_to_all,
        "dequantize_sum": lambda: dequantize_sum_int8(
            received_codes.view(plan.world_size, plan.row_length), received_scales, BLOCK_SIZE,
            plan.alpha, out=row,
        ),
    }
    return median_seconds(stages, repeats)


def training_step_seconds(config_name: str, repeats: int) -> float:
    """Median seconds of one ZeRO-3 step of the demo model with the given ds_configs file."""
    import lazyzero
    from lazyzero.models import build_model

    config = json.loads((ROOT / "ds_configs" / config_name).read_text())
    model = build_model("demo", seed=0, vocab_size=DEMO_VOCAB_SIZE)
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
    generator = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, DEMO_VOCAB_SIZE, STEP_BATCH_SHAPE, generator=generator)

    def step() -> None:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    seconds = median_seconds({"step": step}, repeats)["step"]
    destroy_engine(engine)
    return seconds


def headline_ratios(buckets: dict, steps: dict[str, float]) -> dict[str, float]:
    """The issue's figures: int8 against each baseline at 64 MiB, and the step time ratio."""
    headline = buckets[f"{HEADLINE_MIB}MiB"]
    seconds, wire = headline["seconds"], headline["wire_bytes"]
    return {
        "wire_ratio_vs_fp32": wire["int8"] / wire["fp32"],
        "time_ratio_vs_fp32": seconds["int8"] / seconds["fp32"],
        "time_ratio_vs_bf16": seconds["int8"] / seconds["bf16"],
        "time_ratio_vs_deepspeed": seconds["int8"] / seconds["deepspeed"],
        "step_time_ratio_vs_fp32": steps["int8"] / steps["fp32"],
    }


def measure_comm(quick: bool) -> dict:
    """Every bucket size, then the int8 stages at the headline size."""
    repeats = 5 if quick else 15
    buckets = {}
    for mib in BUCKET_MIB:
        progress(f"reduce-scatter of {mib} MiB buckets")
        buckets[f"{mib}MiB"] = measure_bucket(mib, repeats)
    progress(f"int8 stages at {HEADLINE_MIB} MiB")
    return {"buckets": buckets, "profile": profile_int8_stages(HEADLINE_MIB, repeats)}


def run_rank(rank: int, phase: str, quick: bool, port: int, results: mp.SimpleQueue) -> None:
    """One rank of one phase ("comm" or a STEP_CONFIGS name); rank 0 puts its result in
    `results`."""
    import deepspeed

    os.environ.update(MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE))
    pin_threads(THREADS_PER_RANK)
    deepspeed.init_distributed(dist_backend="gloo")
    if phase == "comm":
        result = measure_comm(quick)
    else:
        progress(f"ZeRO-3 demo steps, {phase} gradients")
        result = training_step_seconds(STEP_CONFIGS[phase], 3 if quick else 10)
    if rank == 0:
        results.put(result)
    dist.barrier()
    dist.destroy_process_group()


def run_phase(phase: str, quick: bool) -> object:
    """Run one phase on fresh ranks and return rank 0's result.

    Fresh processes per phase: a destroyed engine leaves most of its 1.1-1.3 GB a rank resident,
    and two engines side by side ran a 24 GB machine out of memory. It also gives both gradient
    settings the same clean start."""
    results = mp.get_context("spawn").SimpleQueue()
    port = free_port()
    try:
        mp.spawn(run_rank, args=(phase, quick, port, results), nprocs=WORLD_SIZE)
    finally:
        remove_leftover_segments(port)
    return results.get()


def progress(message: str) -> None:
    """One line on rank 0 before each phase, so a slow or stuck run shows where it is."""
    if dist.get_rank() == 0:
        print(f"[bench_grad_comm] {message}", flush=True)


def print_tables(buckets: dict, profile: dict[str, float], steps: dict[str, float]) -> None:
    methods = ("int8", "fp32", "bf16", "deepspeed", "fp32_all_to_all")
    print(f"\nreduce-scatter on {WORLD_SIZE} gloo ranks, {THREADS_PER_RANK} thread each "
          f"(rank 0 medians, ms; wire MiB sent per rank)")
    print(f"{'bucket':>7} " + " ".join(f"{m:>15}" for m in methods)
          + f" {'int8 wire':>10} {'fp32 wire':>10} {'int8 err':>9}")
    for name, bucket in buckets.items():
        seconds, wire = bucket["seconds"], bucket["wire_bytes"]
        print(f"{name:>7} " + " ".join(f"{seconds[m] * 1e3:15.1f}" for m in methods)
              + f" {wire['int8'] / 2**20:10.2f} {wire['fp32'] / 2**20:10.2f}"
              + f" {bucket['int8_relative_error_vs_fp32']:9.2e}")
    total = sum(profile.values())
    print(f"\nint8 exchange at {HEADLINE_MIB} MiB, by stage:")
    for stage, seconds in profile.items():
        print(f"  {stage:>15} {seconds * 1e3:9.1f} ms  {seconds / total:6.1%}")
    print(f"\nZeRO-3 demo step ({STEP_BATCH_SHAPE[0]}x{STEP_BATCH_SHAPE[1]} tokens per rank): "
          f"fp32 {steps['fp32']:.2f} s, int8 {steps['int8']:.2f} s\n")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    pin_threads(THREADS_PER_RANK)  # what the ranks run with, and what write_results records
    # Built once here, so that the ranks only load it instead of racing to compile it.
    if not native_build.ensure_native("cpu"):
        raise SystemExit("the C++ kernels are unavailable:\n" + native_build.format_status(native_build.status()))
    steps = {name: run_phase(name, args.quick) for name in STEP_CONFIGS}
    comm = run_phase("comm", args.quick)
    buckets, profile = comm["buckets"], comm["profile"]
    setup = {"baseline_primitive": BASELINE_PRIMITIVE, "world_size": WORLD_SIZE,
             "threads_per_rank": THREADS_PER_RANK, "block_size": BLOCK_SIZE,
             "timing": "rank 0 medians; every rank times the same collectives in the same order"}
    # Nested, so that readme_table.py shows only the headline ratios as rows.
    details = {"buckets": buckets, f"int8_profile_{HEADLINE_MIB}MiB_seconds": profile,
               "step_seconds": steps, "setup": setup}
    print_tables(buckets, profile, steps)
    write_results(args.out, "bench_grad_comm", args.quick, headline_ratios(buckets, steps), details)


if __name__ == "__main__":
    main()
