"""Saved-activation quantization in real 2-rank DeepSpeed runs on every ZeRO stage (docs/activations.md),
and the offload of a layer's stored activations to NVMe (docs/plan.md).

tests/activations/activations_worker.py trains the tiny Llama 3 steps with activations off and on from
the same seed and data. Packing changes nothing in forward, so the first loss must be identical; the
later ones and the trained parameters differ only by the 4-bit rounding of what backward reads.
With a layer offloaded the bytes backward reads are those it would read kept: everything bit-equal.
"""

import json
import math
import os
from pathlib import Path

import pytest
import torch

from lazyzero.models.build import build_model
from lazyzero.testing import cosines_by_name, run_distributed

WORKER = Path(__file__).resolve().parent / "activations_worker.py"
QUANTIZED_LAYOUTS = ["0", "3+recompute"]
HAS_LIBAIO = Path("/usr/include/libaio.h").exists()  # NVMe offload (.ci/run installs libaio-dev)
# One launch for all: starting 2 ranks costs ~25 s.
DEFAULT_LAYOUTS = [*QUANTIZED_LAYOUTS, *(["3+offload"] if HAS_LIBAIO else [])]
SLOW_LAYOUTS = ["1", "2", "2+recompute", "3"]
# Adam moves every element by about lr whatever its gradient's size, so 4-bit rounding can flip the
# move of elements with tiny gradients; over whole tensors the updates still point the same way.
MIN_UPDATE_COSINE = 0.9
LATER_LOSS_RELATIVE_DIFFERENCE = 1e-2


def update_cosines(on: dict, off: dict) -> dict:
    """Per parameter: cosine between the 3-step updates (from the shared initialization) on and off."""
    initial = {name: p.detach().flatten() for name, p in build_model("tiny", seed=0).named_parameters()}
    return cosines_by_name({name: torch.tensor(on[name]) - start for name, start in initial.items()},
                           {name: torch.tensor(off[name]) - start for name, start in initial.items()})


def run_layouts(out: Path, layouts: list[str]) -> list[dict]:
    (out / "nvme").mkdir()  # the offload's files (layouts with +offload)
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(out), *layouts], timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.fixture(scope="module")
def default_out(tmp_path_factory):
    return tmp_path_factory.mktemp("activations")


@pytest.fixture(scope="module")
def default_run(default_out):
    return run_layouts(default_out, DEFAULT_LAYOUTS)


def check_layout(ranks: list[dict], layout: str) -> None:
    for rank in ranks:
        off, on = rank[layout]["off"], rank[layout]["on"]
        # Forward is not quantized: the first loss differs only by the fused loss head's order of summation.
        assert math.isclose(on["losses"][0], off["losses"][0], rel_tol=1e-6)
        for later_on, later_off in zip(on["losses"][1:], off["losses"][1:]):
            assert math.isfinite(later_on)
            assert abs(later_on - later_off) <= LATER_LOSS_RELATIVE_DIFFERENCE * later_off
        # Every parameter trained, the norms' weights (recomputed from their stored input, rewrites.py)
        # included, and in the direction the unquantized run took.
        cosines = update_cosines(on["params"], off["params"])
        assert all(cosine >= MIN_UPDATE_COSINE for cosine in cosines.values()), cosines  # NaN fails too
        for metrics in on["metrics"]:
            assert 0 < metrics["activation_packed_bytes"] < metrics["activation_saved_bytes"]
        assert all("activation_saved_bytes" not in metrics for metrics in off["metrics"])
        rows = on["report"]["activation_bytes_by_layer"]
        assert set(rows) == {"0", "1", "outside"}
        if "recompute" in layout:
            # Layer 0 is recomputed: it keeps only its input, unpacked, for the recompute.
            assert rows["0"]["packed_bytes"] == rows["0"]["saved_bytes"]
            assert rows["0"]["saved_bytes"] < rows["1"]["saved_bytes"] / 4
        # tiny's attention, kept at 16 bits, is about 45% of what layer 1 saves (55% under ZeRO-3,
        # whose linear function keeps its own copy of each projection's input); the rest is packed.
        assert rows["1"]["packed_bytes"] < 0.7 * rows["1"]["saved_bytes"]


@pytest.mark.parametrize("layout", QUANTIZED_LAYOUTS)
def test_training_with_packed_activations_follows_the_unquantized_run(default_run, layout):
    check_layout(default_run, layout)


@pytest.mark.skipif(not HAS_LIBAIO, reason="NVMe offload needs libaio-dev (.ci/run installs it)")
def test_a_layer_offloaded_to_nvme_trains_as_kept_and_leaves_no_file(default_run, default_out):
    """ZeRO-3, layer 0 on NVMe against the same policy kept: same losses and parameters, bit for
    bit; the step metrics and the report say what left; no file once the ranks have exited."""
    for rank in default_run:
        on, offload = rank["3+offload"]["on"], rank["3+offload"]["offload"]
        assert offload["losses"] == on["losses"]
        assert offload["params"] == on["params"]
        for metrics in offload["metrics"]:
            assert 0 < metrics["activation_offloaded_bytes"] < metrics["activation_packed_bytes"]
            assert metrics["activation_offload_waits"] >= 0 and metrics["activation_offload_wait_s"] >= 0
            assert metrics["activation_offload_write_s"] > 0 and metrics["activation_offload_read_s"] > 0
            assert metrics["activation_offload_reads_ahead"] > 0  # layer 1's backward asked for layer 0's
        assert all("activation_offloaded_bytes" not in metrics for metrics in on["metrics"])
        rows = offload["report"]["activation_bytes_by_layer"]
        assert rows["0"]["offloaded_bytes"] > 0.9 * rows["0"]["packed_bytes"]
        assert rows["1"]["offloaded_bytes"] == rows["outside"]["offloaded_bytes"] == 0
    assert os.listdir(default_out / "nvme") == []


@pytest.mark.slow
def test_the_rest_of_the_zero_stages(tmp_path):
    ranks = run_layouts(tmp_path, SLOW_LAYOUTS)
    for layout in SLOW_LAYOUTS:
        check_layout(ranks, layout)
