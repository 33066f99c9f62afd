"""Run every quantized-collective case on this rank and write the facts to OUT/rank{r}.json.

Usage (under a launcher, gloo): quantized_collectives_worker.py OUT

Every rank generates every rank's input from a seed, so each rank knows the exact fp64 sum of all
inputs without communicating, and judges its own output against it with the bound computed from
the scales it received. The test (tests/gradients/test_quantized_collectives.py) asserts on the facts.
"""

import hashlib
import json
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

from lazyzero.gradients import (
    ChunkLayout,
    any_nonfinite,
    quantized_all_reduce,
    quantized_reduce_scatter,
)
from lazyzero.ops import native_build
from lazyzero.testing import worker_args

BLOCK = 256
ODD_SIZES = (0, 1, 3, 7, BLOCK - 1, BLOCK + 1, 4097, 100003)
WIRE_NUMEL = 1 << 20  # a 4 MiB fp32 bucket
STOCHASTIC_SEEDS = 8


def rank_input(case_seed: int, source: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    """Source rank's input: normal values whose magnitude jumps by powers of ten every 64
    elements, so that neighbouring blocks have very different scales."""
    generator = torch.Generator().manual_seed(case_seed * 1000 + source)
    exponents = torch.randint(-3, 4, (numel // 64 + 1,), generator=generator)
    magnitude = (10.0**exponents).repeat_interleave(64)[:numel]
    return (torch.randn(numel, generator=generator) * magnitude).to(dtype)


def all_inputs(case_seed: int, numel: int, world: int, dtype=torch.float32) -> list[torch.Tensor]:
    return [rank_input(case_seed, source, numel, dtype) for source in range(world)]


def exact(inputs: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """alpha * sum of all ranks' inputs, in fp64."""
    return sum(x.double() for x in inputs) * alpha


def owned(full: torch.Tensor, layout: ChunkLayout, rank: int) -> torch.Tensor:
    """This rank's pieces of a full-length tensor, back to back (its expected output)."""
    return torch.cat([full[offset : offset + length] for offset, length in layout.pieces[rank]]
                     + [full.new_empty(0)])


def bound_facts(output: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> dict:
    """How the output compares with the exact result: excess over the bound (must be <= 0),
    the worst error as a fraction of the bound, and the elements whose bound is 0."""
    error = (output.double() - expected).abs()
    positive = bound > 0
    zero_bound = bound == 0
    return {
        "numel": output.numel(),
        "excess": float((error - bound).max()) if output.numel() else 0.0,
        "worst_fraction": max((error[positive] / bound[positive]).tolist(), default=0.0),
        "zero_bound_elements": int(zero_bound.sum()),
        "zero_bound_outputs_exact": bool((output[zero_bound] == 0).all()),
        "all_finite": bool(torch.isfinite(output).all()),
    }


def check_reduce_scatter(inputs, rank, layout=None, average=True, **options) -> dict:
    result = quantized_reduce_scatter(inputs[rank], layout=layout, average=average, **options)
    layout = result.plan.layout
    expected = owned(exact(inputs, result.plan.alpha), layout, rank)
    facts = bound_facts(result.output, expected, result.error_bound())
    facts.update(
        expected_numel=layout.segment_length(rank),
        piece_lengths=[piece.numel() for piece in result.pieces()],
        wire_bytes=result.wire_bytes,
        fp32_wire_bytes=result.fp32_wire_bytes,
        any_nonfinite=any_nonfinite(result.output),
    )
    return facts


def odd_size_cases(rank: int, world: int) -> dict:
    cases = {}
    for numel in ODD_SIZES:
        inputs = all_inputs(numel, numel, world)
        facts = check_reduce_scatter(inputs, rank)
        facts["deepspeed_numel"] = deepspeed_piece_lengths(inputs[rank], [numel])[0]
        cases[f"rs/fp32/{numel}"] = facts
    cases["rs/sum/4097"] = check_reduce_scatter(all_inputs(11, 4097, world), rank, average=False)
    cases["rs/bf16/block32/1000"] = check_reduce_scatter(
        all_inputs(12, 1000, world, torch.bfloat16), rank, block_size=32)
    cases["rs/fp16/4097"] = check_reduce_scatter(all_inputs(13, 4097, world, torch.float16), rank)
    return cases


def zero_block_case(rank: int, world: int) -> dict:
    """The first three blocks of every owner's chunk are zero on every rank: exact zeros out."""
    numel = 4097
    chunk = -(-numel // world)
    inputs = all_inputs(14, numel, world)
    for x in inputs:
        for owner in range(world):
            x[owner * chunk : owner * chunk + 3 * BLOCK] = 0.0
    return {"rs/zero_blocks/4097": check_reduce_scatter(inputs, rank)}


def deepspeed_piece_lengths(flat: torch.Tensor, sizes: list[int]) -> list[int]:
    """Lengths of this rank's chunks from DeepSpeed's own stage-3 reduce-scatter of the tensors."""
    tensors = [piece.clone() for piece in torch.split(flat, sizes)]
    return [chunk.numel() for chunk in reduce_scatter_coalesced(tensors)]


def layout_cases(rank: int, world: int) -> dict:
    sizes = [1, 7, 300, 4097, 0, 5]
    inputs = all_inputs(15, sum(sizes), world)
    per_tensor = check_reduce_scatter(inputs, rank, layout=ChunkLayout.per_tensor(sizes, world))
    per_tensor["deepspeed_piece_lengths"] = deepspeed_piece_lengths(inputs[rank], sizes)
    # Stage 1/2 style: owners' ranges interleaved, not in rank order, some owners own two ranges.
    ranges = [(world - 1, 0, 700), (0, 700, 1000), (world - 1, 1700, 300), (1, 2000, 1000)]
    by_ranges = check_reduce_scatter(all_inputs(16, 3000, world), rank,
                                     layout=ChunkLayout.from_ranges(3000, world, ranges))
    return {"rs/layout/per_tensor": per_tensor, "rs/layout/ranges": by_ranges}


def stochastic_cases(rank: int, world: int) -> dict:
    numel = 100003
    inputs = all_inputs(17, numel, world)
    runs = [quantized_reduce_scatter(inputs[rank], stochastic=True, seed=seed)
            for seed in range(STOCHASTIC_SEEDS)]
    repeat = quantized_reduce_scatter(inputs[rank], stochastic=True, seed=0)
    expected = owned(exact(inputs, 1.0 / world), runs[0].plan.layout, rank)
    mean = torch.stack([run.output.double() for run in runs]).mean(dim=0)
    facts = bound_facts(runs[0].output, expected, runs[0].error_bound())
    facts.update(
        same_seed_identical=torch.equal(repeat.output, runs[0].output),
        other_seed_differs=not torch.equal(runs[1].output, runs[0].output),
        all_seeds_within_bound=all(
            bound_facts(run.output, expected, run.error_bound())["excess"] <= 0 for run in runs),
        single_error_sq=float(((runs[0].output.double() - expected) ** 2).sum()),
        mean_error_sq=float(((mean - expected) ** 2).sum()),
    )
    return {"stochastic": facts}


def normal_inputs(case_seed: int, numel: int, world: int) -> list[torch.Tensor]:
    """Plain standard normal inputs: no element is far below its block's code step."""
    return [torch.randn(numel, generator=torch.Generator().manual_seed(case_seed * 1000 + source))
            for source in range(world)]


def error_feedback_case(rank: int, world: int) -> dict:
    """Two steps with different gradients, with and without carrying the residual. Normal inputs:
    with magnitudes that jump by powers of ten, values far below the step stay below it in both
    steps, and feedback cannot recover them."""
    numel = 100003
    steps = [normal_inputs(18, numel, world), normal_inputs(19, numel, world)]
    residual = torch.zeros(numel)
    with_feedback = [quantized_reduce_scatter(inputs[rank], residual=residual) for inputs in steps]
    without = [quantized_reduce_scatter(inputs[rank]) for inputs in steps]
    layout = with_feedback[0].plan.layout
    expected = sum(owned(exact(inputs, 1.0 / world), layout, rank) for inputs in steps)
    total_with = with_feedback[0].output.double() + with_feedback[1].output.double()
    total_without = without[0].output.double() + without[1].output.double()
    return {"error_feedback": {
        "error_sq_with": float(((total_with - expected) ** 2).sum()),
        "error_sq_without": float(((total_without - expected) ** 2).sum()),
        "residual_finite": bool(torch.isfinite(residual).all()),
        "residual_nonzero": bool((residual != 0).any()),
    }}


def poisoned_inputs(world: int, numel: int) -> tuple[list[torch.Tensor], list[int]]:
    """Rank 1's input holds a NaN (owned by rank 0) and +Inf, -Inf (owned by the last rank)."""
    inputs = all_inputs(20, numel, world)
    poisoned = [10, numel - 5, numel - 3]
    inputs[1][poisoned[0]] = float("nan")
    inputs[1][poisoned[1]] = float("inf")
    inputs[1][poisoned[2]] = float("-inf")
    return inputs, poisoned


def affected_mask(layout: ChunkLayout, rank: int, poisoned: list[int]) -> torch.Tensor:
    """Elements of this rank's segment that share a row block with a poisoned element."""
    ((offset, length),) = layout.pieces[rank]
    mask = torch.zeros(length, dtype=torch.bool)
    for element in poisoned:
        if offset <= element < offset + length:
            start = (element - offset) // BLOCK * BLOCK
            mask[start : start + BLOCK] = True
    return mask


def nonfinite_cases(rank: int, world: int) -> dict:
    numel = 4097
    inputs, poisoned = poisoned_inputs(world, numel)
    residual = torch.zeros(numel)
    result = quantized_reduce_scatter(inputs[rank], residual=residual)
    affected = affected_mask(result.plan.layout, rank, poisoned)
    expected = owned(exact(inputs, 1.0 / world), result.plan.layout, rank)
    unaffected = ~affected
    clean = bound_facts(result.output[unaffected], expected[unaffected],
                        result.error_bound()[unaffected])
    reduced = quantized_all_reduce(inputs[rank])
    full_mask = torch.cat([affected_mask(result.plan.layout, owner, poisoned)
                           for owner in range(world)])
    return {"nonfinite": {
        "any_nonfinite": any_nonfinite(result.output),
        "affected_elements": int(affected.sum()),
        "affected_all_nonfinite": bool((~torch.isfinite(result.output[affected])).all()),
        "unaffected_excess": clean["excess"],
        "unaffected_finite": clean["all_finite"],
        "residual_finite": bool(torch.isfinite(residual).all()),
        "all_reduce_any_nonfinite": any_nonfinite(reduced.output),
        "all_reduce_affected_elements": int(full_mask.sum()),
        "all_reduce_affected_all_nonfinite": not torch.isfinite(reduced.output[full_mask]).any(),
        "all_reduce_unaffected_finite": bool(torch.isfinite(reduced.output[~full_mask]).all()),
    }}


def check_all_reduce(inputs, rank, **options) -> dict:
    result = quantized_all_reduce(inputs[rank], **options)
    owned_part = result.owned_slice()
    expected = exact(inputs, result.plan.alpha)[owned_part]
    facts = bound_facts(result.output[owned_part], expected, result.owned_error_bound())
    facts.update(
        output_numel=result.output.numel(),
        output_sha256=hashlib.sha256(result.output.numpy().tobytes()).hexdigest(),
        wire_bytes=result.wire_bytes,
        fp32_wire_bytes=result.fp32_wire_bytes,
    )
    return facts


def all_reduce_cases(rank: int, world: int) -> dict:
    cases = {f"ar/fp32/{numel}": check_all_reduce(all_inputs(numel, numel, world), rank)
             for numel in (0, 1, 7, 4097, 100003)}
    cases["ar/stochastic/4097"] = check_all_reduce(all_inputs(21, 4097, world), rank,
                                                   stochastic=True, seed=3)
    return cases


def wire_cases(rank: int, world: int) -> dict:
    inputs = all_inputs(22, WIRE_NUMEL, world)
    return {"wire/rs": check_reduce_scatter(inputs, rank),
            "wire/ar": check_all_reduce(inputs, rank)}


def main() -> None:
    args = worker_args()
    out = Path(args[0])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {"native_cpu_kernels": native_build.ensure_native("cpu")}
    for cases in (odd_size_cases, zero_block_case, layout_cases, stochastic_cases,
                  error_feedback_case, nonfinite_cases, all_reduce_cases, wire_cases):
        results.update(cases(rank, world))
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
