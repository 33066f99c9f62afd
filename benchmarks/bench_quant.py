"""Throughput of the C++ int8 quant kernels against the PyTorch reference and a plain copy.

All cases use the same 64 MiB of fp32 input on 2 threads; GB/s counts bytes read plus bytes
written. Like the copy baseline (`dst.copy_(src)`), the kernel cases write into preallocated
buffers (the `_into` ops): a fresh 64 MiB output would otherwise be dominated by the kernel zeroing
new pages on first touch. The `*_alloc_gbps` cases show what the allocating ops cost as called.
Targets (issue): quantize >= 0.5 x memcpy and >= 4 x the reference.

On a machine with a GPU the same cases also run on it (`gpu_*` keys) over 1 GiB of fp32, so that
a pass (about half a millisecond on an H200) is long beside a kernel launch; there the copy
baseline is a device-to-device copy and every timing is synchronized.

    python benchmarks/bench_quant.py --quick --out results/bench_quant.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `common` sits beside this script
from common import gbps, median_seconds, parse_args, pin_threads, write_results  # noqa: E402

import lazyzero.ops.quant  # noqa: E402, F401  (defines the torch.ops.lazyzero schemas)
from lazyzero.ops import native_build, quant_reference  # noqa: E402

THREADS = 2
INPUT_BYTES = 64 * 2**20
GPU_INPUT_BYTES = 2**30
BLOCK_SIZE = 256
SUM_ROWS = 4  # chunks reduced by the fused dequantize-sum, as after a 4-rank all-to-all


def cases_and_bytes(x: torch.Tensor) -> tuple[dict, dict[str, int]]:
    """The timed callables and the bytes each one reads plus writes."""
    ops = torch.ops.lazyzero
    n = x.numel()
    codes, scales = ops.quantize_int8(x, BLOCK_SIZE, False, 0)
    rows_codes, rows_scales = codes.view(SUM_ROWS, -1), scales.view(SUM_ROWS, -1)
    restored = torch.empty_like(x)
    summed = torch.empty(n // SUM_ROWS, device=x.device)
    copy_destination = torch.empty_like(x)
    cases = {
        "quant": lambda: ops.quantize_int8_into(x, BLOCK_SIZE, False, 0, codes, scales),
        "dequant": lambda: ops.dequantize_int8_into(codes, scales, BLOCK_SIZE, restored),
        "dequant_sum": lambda: ops.dequantize_sum_int8_into(
            rows_codes, rows_scales, BLOCK_SIZE, 1 / SUM_ROWS, summed
        ),
        "quant_alloc": lambda: ops.quantize_int8(x, BLOCK_SIZE, False, 0),
        "dequant_alloc": lambda: ops.dequantize_int8(codes, scales, BLOCK_SIZE, torch.float32),
        "ref_quant": lambda: quant_reference.quantize_int8(x, BLOCK_SIZE, False, 0),
        "memcpy": lambda: copy_destination.copy_(x),
    }
    quant_bytes = 4 * n + n + 4 * scales.numel()  # fp32 in; int8 codes and fp32 scales out
    dequant_bytes = n + 4 * scales.numel() + 4 * n
    moved = {
        "quant": quant_bytes,
        "dequant": dequant_bytes,
        "dequant_sum": n + 4 * scales.numel() + 4 * summed.numel(),
        "quant_alloc": quant_bytes,
        "dequant_alloc": dequant_bytes,
        "ref_quant": quant_bytes,
        "memcpy": 2 * 4 * n,
    }
    return cases, moved


def measure(quick: bool, device: str = "cpu", input_bytes: int = INPUT_BYTES, prefix: str = "") -> dict[str, float]:
    x = torch.randn(input_bytes // 4, generator=torch.Generator().manual_seed(0)).to(device)
    cases, moved = cases_and_bytes(x)
    seconds = median_seconds(cases, repeats=5 if quick else 21)
    results = {f"{prefix}{name}_gbps": gbps(moved[name], seconds[name]) for name in cases}
    results[f"{prefix}quant_vs_memcpy"] = results[f"{prefix}quant_gbps"] / results[f"{prefix}memcpy_gbps"]
    results[f"{prefix}quant_vs_ref"] = results[f"{prefix}quant_gbps"] / results[f"{prefix}ref_quant_gbps"]
    return results


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    pin_threads(THREADS)
    if not native_build.ensure_native("cpu"):
        raise SystemExit("the C++ kernels are unavailable:\n" + native_build.format_status(native_build.status()))
    results = measure(args.quick)
    if torch.cuda.is_available():
        native_build.ensure_native("cuda")  # raises, naming the reason, when the CUDA kernels cannot load
        results.update(measure(args.quick, "cuda", GPU_INPUT_BYTES, prefix="gpu_"))
    write_results(args.out, "bench_quant", args.quick, results)


if __name__ == "__main__":
    main()
