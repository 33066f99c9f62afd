"""Int8 reduce-scatter and all-reduce on real processes (gloo, 2 and 4 ranks): docs/reliability.md rows
8 and 9. One launch per world size runs every case (tests/gradients/quantized_collectives_worker.py); the
tests below judge the facts each rank wrote."""

import json
from pathlib import Path

import pytest
from worker_facts import cases

from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "quantized_collectives_worker.py"
WIRE_RATIO_TARGET = 0.27  # docs/gradients.md: int8 bytes on the wire at most 0.27 x fp32


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request, tmp_path_factory) -> list[dict]:
    """Per rank, the facts of every case: one launch of the worker per world size."""
    out = tmp_path_factory.mktemp(f"comm{request.param}")
    proc = run_distributed("deepspeed", request.param, [str(WORKER), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(request.param)]


@pytest.mark.multiproc
def test_reduce_scatter_is_within_the_bound_on_odd_sizes(ranks):
    for rank, name, facts in cases(ranks, "rs/"):
        assert facts["excess"] <= 0, f"{name} rank {rank}: over the bound by {facts['excess']}"
        assert facts["all_finite"], f"{name} rank {rank}"
        assert facts["numel"] == facts["expected_numel"], f"{name} rank {rank}"
        assert not facts["any_nonfinite"], f"{name} rank {rank}"
    # The bound is tight enough to mean something: the worst error uses a good part of it.
    worst = max(facts["worst_fraction"] for _, _, facts in cases(ranks, "rs/fp32/100003"))
    assert 0.1 < worst <= 1.0


@pytest.mark.multiproc
def test_owned_lengths_follow_deepspeed_chunking(ranks):
    for rank, name, facts in cases(ranks, "rs/fp32/"):
        assert facts["numel"] == facts["deepspeed_numel"], f"{name} rank {rank}"
    for rank, _, facts in cases(ranks, "rs/layout/per_tensor"):
        assert facts["piece_lengths"] == facts["deepspeed_piece_lengths"], f"rank {rank}"
    # The worker's ranges: (W-1, 0, 700), (0, 700, 1000), (W-1, 1700, 300), (1, 2000, 1000).
    expected = {2: [1000, 2000], 4: [1000, 1000, 0, 1000]}[len(ranks)]
    assert [facts["numel"] for _, _, facts in cases(ranks, "rs/layout/ranges")] == expected


@pytest.mark.multiproc
def test_zero_blocks_come_out_exactly_zero(ranks):
    for rank, _, facts in cases(ranks, "rs/zero_blocks/"):
        assert facts["zero_bound_elements"] >= 3 * 256, f"rank {rank}"
        assert facts["zero_bound_outputs_exact"], f"rank {rank}"


@pytest.mark.multiproc
def test_stochastic_rounding_is_seeded_bounded_and_unbiased(ranks):
    for rank, _, facts in cases(ranks, "stochastic"):
        assert facts["same_seed_identical"] and facts["other_seed_differs"], f"rank {rank}"
        assert facts["all_seeds_within_bound"], f"rank {rank}"
    # Unbiased and independent across seeds: the mean of 8 seeded runs has about 1/sqrt(8) = 0.35
    # of one run's rms error (over ~1e5 elements the estimate is within a few percent).
    single = sum(facts["single_error_sq"] for _, _, facts in cases(ranks, "stochastic"))
    mean = sum(facts["mean_error_sq"] for _, _, facts in cases(ranks, "stochastic"))
    assert (mean / single) ** 0.5 < 0.5


@pytest.mark.multiproc
def test_error_feedback_brings_two_steps_closer_to_the_exact_sum(ranks):
    found = cases(ranks, "error_feedback")
    for rank, _, facts in found:
        assert facts["residual_finite"] and facts["residual_nonzero"], f"rank {rank}"
    # Without feedback two independent rounding errors add up (rms x sqrt 2); with it the first
    # step's error is sent again in the second, leaving about one step's error: ratio ~0.71.
    with_feedback = sum(facts["error_sq_with"] for _, _, facts in found)
    without = sum(facts["error_sq_without"] for _, _, facts in found)
    assert (with_feedback / without) ** 0.5 < 0.8


@pytest.mark.multiproc
def test_nan_and_inf_on_one_rank_are_seen_by_every_rank(ranks):
    found = cases(ranks, "nonfinite")
    for rank, _, facts in found:
        assert facts["any_nonfinite"] and facts["all_reduce_any_nonfinite"], f"rank {rank}"
        assert facts["affected_all_nonfinite"], f"rank {rank}: a poisoned block came out finite"
        assert facts["unaffected_finite"] and facts["unaffected_excess"] <= 0, f"rank {rank}"
        assert facts["residual_finite"], f"rank {rank}: NaN carried into the residual"
        assert facts["all_reduce_affected_elements"] > 0
        assert facts["all_reduce_affected_all_nonfinite"], f"rank {rank}"
        assert facts["all_reduce_unaffected_finite"], f"rank {rank}"
    # The NaN (owner 0) and the Infs (last owner) reach their owners' outputs.
    affected = [facts["affected_elements"] for _, _, facts in found]
    assert affected[0] > 0 and affected[-1] > 0


@pytest.mark.multiproc
def test_all_reduce_is_identical_on_every_rank_and_within_the_bound(ranks):
    by_name: dict[str, set] = {}
    for rank, name, facts in cases(ranks, "ar/"):
        assert facts["excess"] <= 0, f"{name} rank {rank}: over the bound by {facts['excess']}"
        assert facts["all_finite"], f"{name} rank {rank}"
        by_name.setdefault(name, set()).add(facts["output_sha256"])
    assert all(len(hashes) == 1 for hashes in by_name.values()), by_name


@pytest.mark.multiproc
def test_wire_bytes_are_at_most_027_of_fp32(ranks):
    for name in ("wire/rs", "wire/ar"):
        for rank, _, facts in cases(ranks, name):
            ratio = facts["wire_bytes"] / facts["fp32_wire_bytes"]
            assert ratio <= WIRE_RATIO_TARGET, f"{name} rank {rank}: {ratio:.4f}"
            assert facts["excess"] <= 0
