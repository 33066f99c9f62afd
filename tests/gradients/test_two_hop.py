"""Two-hop int8 exchange, 2 "nodes" x 2 ranks on gloo (docs/reliability.md rows 8 and 9): within the
bound against the exact sum, zero blocks exact, NaN/Inf seen by every rank, fewer bytes across
nodes. One launch (tests/gradients/two_hop_worker.py)."""

import json
from pathlib import Path

import pytest
from worker_facts import cases

from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "two_hop_worker.py"
WORLD = 4


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("two_hop")
    proc = run_distributed("deepspeed", WORLD, [str(WORKER), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.multiproc
def test_ranks_are_placed_node_by_node(ranks):
    assert [(result["node"], result["local_rank"]) for result in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.multiproc
def test_two_hop_reduce_scatter_is_within_the_bound_on_odd_sizes_and_layouts(ranks):
    for rank, name, facts in cases(ranks, "rs/"):
        assert facts["excess"] <= 0, f"{name} rank {rank}: over the bound by {facts['excess']}"
        assert facts["all_finite"] and not facts["any_nonfinite"], f"{name} rank {rank}"
        assert facts["numel"] == facts["expected_numel"], f"{name} rank {rank}"
    worst = max(facts["worst_fraction"] for _, _, facts in cases(ranks, "rs/100003"))
    assert 0.1 < worst <= 1.0, "the bound should be tight enough to mean something"


@pytest.mark.multiproc
def test_zero_blocks_come_out_exactly_zero_after_two_hops(ranks):
    # Three zero blocks per owner; the first hop's rows hold two owners back to back, so on the
    # second node's owners its blocks straddle theirs and two whole zero blocks remain.
    for rank, _, facts in cases(ranks, "rs/zero_blocks"):
        assert facts["zero_bound_elements"] >= 2 * 256 and facts["zero_bound_outputs_exact"], f"rank {rank}"


@pytest.mark.multiproc
def test_two_hop_all_reduce_is_identical_everywhere_and_within_the_bound(ranks):
    hashes: dict[str, set] = {}
    for rank, name, facts in cases(ranks, "ar/"):
        assert facts["excess"] <= 0, f"{name} rank {rank}"
        hashes.setdefault(name, set()).add(facts["output_sha256"])
    assert all(len(found) == 1 for found in hashes.values()), hashes


@pytest.mark.multiproc
def test_bytes_across_nodes_are_a_third_of_a_flat_int8_exchange_and_total_under_027_of_fp32(ranks):
    for rank, _, facts in cases(ranks, "traffic"):
        assert facts["excess"] <= 0
        assert facts["wire_bytes"] <= 0.27 * facts["fp32_wire_bytes"], f"rank {rank}"
        # Flat: 3 quarter rows leave the rank; across nodes one quarter row (the other node's owner).
        assert facts["across_nodes_bytes"] * 3 == pytest.approx(facts["flat_int8_bytes"], rel=0.01)


@pytest.mark.multiproc
def test_error_feedback_covers_the_first_hop(ranks):
    found = cases(ranks, "error_feedback")
    assert all(facts["residual_nonzero_and_finite"] for _, _, facts in found)
    with_feedback = sum(facts["error_sq_with"] for _, _, facts in found)
    without = sum(facts["error_sq_without"] for _, _, facts in found)
    assert with_feedback < without


@pytest.mark.multiproc
def test_nan_and_inf_on_one_rank_reach_their_owners_through_both_hops(ranks):
    found = cases(ranks, "nonfinite")
    for rank, _, facts in found:
        assert facts["any_nonfinite"], f"rank {rank}: the overflow was not seen"
        assert facts["affected_all_nonfinite"], f"rank {rank}: a poisoned block came out finite"
    affected = [facts["affected_elements"] for _, _, facts in found]
    assert affected[0] > 0 and affected[-1] > 0
