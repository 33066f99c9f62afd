"""Two-hop int8 reduce-scatter and all-reduce on 2 "nodes" x 2 ranks; facts to OUT/rank{r}.json.

Usage (under a launcher, gloo, 4 ranks): two_hop_worker.py OUT

Inputs, exact sums and fact checks are those of quantized_collectives_worker.py; the bound of a two-hop
result is its own (`TwoHopResult.error_bound`, itself a collective).
"""

import hashlib
import json
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from quantized_collectives_worker import (
    BLOCK,
    ODD_SIZES,
    WIRE_NUMEL,
    affected_mask,
    all_inputs,
    bound_facts,
    exact,
    normal_inputs,
    owned,
    poisoned_inputs,
)

from lazyzero.gradients import (
    ChunkLayout,
    any_nonfinite,
    build_node_groups,
    quantized_all_reduce,
    quantized_reduce_scatter,
    two_hop_reduce_scatter,
)
from lazyzero.testing import worker_args

RANKS_PER_NODE = 2


def check_two_hop(inputs, rank, nodes, layout=None, **options) -> dict:
    world = nodes.world_size
    result = two_hop_reduce_scatter(inputs[rank], nodes, layout=layout, scale=1.0 / world, **options)
    expected = owned(exact(inputs, 1.0 / world), result.layout, rank)
    facts = bound_facts(result.output, expected, result.error_bound())
    facts.update(
        expected_numel=result.layout.segment_length(rank),
        wire_bytes=result.wire_bytes,
        fp32_wire_bytes=result.fp32_wire_bytes,
        any_nonfinite=any_nonfinite(result.output),
    )
    return facts


def reduce_scatter_cases(rank: int, world: int, nodes) -> dict:
    cases = {f"rs/{numel}": check_two_hop(all_inputs(numel, numel, world), rank, nodes) for numel in ODD_SIZES}
    sizes = [1, 7, 300, 4097, 0, 5]
    cases["rs/per_tensor"] = check_two_hop(all_inputs(15, sum(sizes), world), rank, nodes,
                                           layout=ChunkLayout.per_tensor(sizes, world))
    ranges = [(world - 1, 0, 700), (0, 700, 1000), (world - 1, 1700, 300), (1, 2000, 1000)]
    cases["rs/ranges"] = check_two_hop(all_inputs(16, 3000, world), rank, nodes,
                                       layout=ChunkLayout.from_ranges(3000, world, ranges))
    cases["rs/stochastic"] = check_two_hop(all_inputs(17, 100003, world), rank, nodes, stochastic=True, seed=4)
    zeroed = all_inputs(14, 4097, world)
    chunk = -(-4097 // world)
    for x in zeroed:
        for owner in range(world):
            x[owner * chunk : owner * chunk + 3 * BLOCK] = 0.0
    cases["rs/zero_blocks"] = check_two_hop(zeroed, rank, nodes)
    return cases


def all_reduce_cases(rank: int, world: int, nodes) -> dict:
    cases = {}
    for numel in (0, 7, 4097, 100003):
        inputs = all_inputs(numel, numel, world)
        result = quantized_all_reduce(inputs[rank], nodes=nodes)
        part = result.owned_slice()
        facts = bound_facts(result.output[part], exact(inputs, result.plan.alpha)[part], result.owned_error_bound())
        facts["output_sha256"] = hashlib.sha256(result.output.numpy().tobytes()).hexdigest()
        cases[f"ar/{numel}"] = facts
    return cases


def traffic_case(rank: int, world: int, nodes) -> dict:
    """Bytes of a 4 MiB bucket: in total and across nodes, against one flat int8 exchange."""
    inputs = all_inputs(22, WIRE_NUMEL, world)
    facts = check_two_hop(inputs, rank, nodes)
    two_hop = two_hop_reduce_scatter(inputs[rank], nodes)
    flat = quantized_reduce_scatter(inputs[rank])
    facts.update(across_nodes_bytes=two_hop.across.wire_bytes, flat_int8_bytes=flat.wire_bytes)
    return {"traffic": facts}


def error_feedback_case(rank: int, world: int, nodes) -> dict:
    numel = 100003
    steps = [normal_inputs(18, numel, world), normal_inputs(19, numel, world)]
    residual = torch.zeros(numel)
    with_feedback = [two_hop_reduce_scatter(inputs[rank], nodes, residual=residual) for inputs in steps]
    without = [two_hop_reduce_scatter(inputs[rank], nodes) for inputs in steps]
    layout = with_feedback[0].layout
    expected = sum(owned(exact(inputs, 1.0), layout, rank) for inputs in steps)
    total_with = sum(result.output.double() for result in with_feedback)
    total_without = sum(result.output.double() for result in without)
    return {"error_feedback": {
        "error_sq_with": float(((total_with - expected) ** 2).sum()),
        "error_sq_without": float(((total_without - expected) ** 2).sum()),
        "residual_nonzero_and_finite": bool((residual != 0).any() and torch.isfinite(residual).all()),
    }}


def nonfinite_case(rank: int, world: int, nodes) -> dict:
    inputs, poisoned = poisoned_inputs(world, 4097)
    result = two_hop_reduce_scatter(inputs[rank], nodes)
    affected = affected_mask(result.layout, rank, poisoned)
    return {"nonfinite": {
        "any_nonfinite": any_nonfinite(result.output),
        "affected_elements": int(affected.sum()),
        "affected_all_nonfinite": bool((~torch.isfinite(result.output[affected])).all()),
    }}


def main() -> None:
    out = Path(worker_args()[0])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = build_node_groups(None, RANKS_PER_NODE)
    results = {"node": nodes.node, "local_rank": nodes.local_rank}
    for cases in (reduce_scatter_cases, all_reduce_cases, traffic_case, error_feedback_case, nonfinite_case):
        results.update(cases(rank, world, nodes))
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
