"""The 8-bit optimizer's states swapped to NVMe at their real size (lazyzero/optimizer/nvme_swap.py),
in real 2-rank ZeRO-3 runs (tests/optimizer/optim8bit_nvme_worker.py): the same training as with CPU
optimizer offload, swap files about a quarter of fp32 moments, and an exact resume."""

import json
from pathlib import Path

import pytest

from lazyzero.optimizer.nvme_swap import PACKED_FILE_SUFFIX
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "optim8bit_nvme_worker.py"
BLOCK_SIZE = 256  # lazyzero.optimizer.block_size's default, which the worker keeps

needs_libaio = pytest.mark.skipif(not Path("/usr/include/libaio.h").exists(),
                                  reason="NVMe offload needs libaio-dev (.ci/run installs it)")
pytestmark = [pytest.mark.multiproc, needs_libaio]


def run_worker(out: Path, mode: str, *options: str) -> list[dict]:
    proc = run_distributed("deepspeed", 2, [str(WORKER), mode, str(out), *options], timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [json.loads((out / f"{mode}_rank{rank}.json").read_text()) for rank in range(2)]


def test_nvme_offload_trains_exactly_as_cpu_offload(tmp_path):
    for rank in run_worker(tmp_path, "offload"):
        # Same host arithmetic on the same bytes: the swap files hold states and masters exactly,
        # also when the pipelined swapper reads the next sub-group while one steps.
        for swapper in ("nvme", "nvme_pipelined"):
            assert rank[swapper]["losses"] == rank["cpu"]["losses"], swapper
            assert rank[swapper]["parameters"] == rank["cpu"]["parameters"], swapper
            # One swapped sub-group of each precision (the worker's MIXED_FRACTION).
            assert rank[swapper]["packed_files"] == 1 and rank[swapper]["fp32_moment_files"] == 1, swapper
        assert rank["nvme"]["swapper"] == "EightBitStateSwapper"
        assert rank["nvme_pipelined"]["swapper"] == "EightBitPipelinedSwapper"


def test_packed_8bit_swap_files_are_a_quarter_of_fp32_moments(tmp_path):
    for rank in run_worker(tmp_path, "swap_files"):
        eight_bit, fp32 = rank["8bit"], rank["fp32"]
        packed = {name: size for name, size in eight_bit.items() if name.endswith(PACKED_FILE_SUFFIX)}
        # Two sub-groups of the 8-bit group are large enough to swap; DeepSpeed wrote no code tensors itself.
        assert len(packed) == 2, eight_bit
        assert not any(name.startswith(("m_", "sqrt_v_")) for name in eight_bit), eight_bit
        moments = sum(size for name, size in fp32.items() if name.startswith(("exp_avg-", "exp_avg_sq-")))
        # Per element: 2 code bytes + 8/BLOCK_SIZE scale bytes against 8; the fp32 run also swaps the
        # 1024 biases its sub-groups hold (0.1%) and each file is padded to 1 KiB.
        expected = (2 + 8 / BLOCK_SIZE) / 8
        assert abs(sum(packed.values()) / moments - expected) < 0.005, (packed, moments)


@pytest.fixture(scope="module")
def deepspeed_save(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("nvme_save")
    return out, run_worker(out, "save", "deepspeed")


def check_resume(out: Path, saved: list[dict], *options: str) -> None:
    # Another launch: DeepSpeed names swap files by parameter ids, which count up within a process.
    loaded = run_worker(out, "load", *options)
    for before, after in zip(saved, loaded):
        assert after["resumed"] == before["continued"]
        assert after["parameters"] == before["parameters"]
        assert len(before["packed"]) == 2
        assert after["packed"] == before["packed"]


@pytest.mark.slow  # 8-bit states resume exactly in the default suite: tests/optimizer/test_engine_8bit.py
def test_resume_from_a_checkpoint_is_exact(deepspeed_save):
    check_resume(*deepspeed_save, "deepspeed")


@pytest.mark.slow
def test_resume_from_a_lazy_checkpoint_is_exact(tmp_path):
    check_resume(tmp_path, run_worker(tmp_path, "save", "lazy"), "lazy")


@pytest.mark.slow
def test_resume_through_the_pipelined_swapper_is_exact(tmp_path):
    """Saved and resumed with the pipelined swapper: its writes are complete when the checkpoint
    copies the swap folder, and the restore reads every sub-group back through it."""
    check_resume(tmp_path, run_worker(tmp_path, "save", "deepspeed", "pipelined"), "deepspeed", "pipelined")


@pytest.mark.slow  # re-splitting 8-bit states on another rank count: tests/optimizer/test_engine_8bit.py
def test_reload_on_another_number_of_ranks_reads_and_writes_swap_files(deepspeed_save):
    """The 2-rank checkpoints loaded on 1 rank. NVMe and CPU offload train alike bit for bit (above),
    so the NVMe checkpoint re-split with NVMe offload must continue exactly as the CPU checkpoint
    re-split with CPU offload, whose pieces test_engine_8bit.py checks one by one."""
    out, saved = deepspeed_save
    assert saved[0]["first"] == saved[0]["first_cpu"]
    proc = run_distributed("deepspeed", 1, [str(WORKER), "reshard", str(out)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    result = json.loads((out / "reshard_rank0.json").read_text())
    reference = result["cpu_from_cpu"]
    assert all(loss == loss and abs(loss) < 1e3 for loss in reference["losses"]), reference["losses"]
    assert result["nvme_from_nvme"]["losses"] == reference["losses"]
    assert result["nvme_from_nvme"]["parameters"] == reference["parameters"]
    # This run swapped its own 8-bit states (two sub-groups large enough) after the re-split.
    assert result["nvme_from_nvme"]["packed_files"] == 2
