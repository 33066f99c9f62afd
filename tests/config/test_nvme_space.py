"""ZeRO's NVMe swap files need room: a folder whose filesystem cannot hold them is refused at start,
naming the key, the folder, the bytes needed and free (docs/reliability.md, guarantee 4). The small
filesystem is a real 64 KiB tmpfs."""

from pathlib import Path

import pytest

from lazyzero.config.nvme_space import nvme_swap_problems, ranks_on_this_node
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "nvme_space_worker.py"


def _config(folder, optimizer="AdamW", **extra) -> dict:
    return {"optimizer": {"type": optimizer},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(folder)}},
            **extra}


def test_optimizer_swap_files_larger_than_the_filesystem_are_refused(small_filesystem):
    # 20,000 parameters over 2 ranks, both on this node: 2 x 10,000 x (4 master + 8 Adam) = 240,000 bytes.
    problems = nvme_swap_problems(_config(small_filesystem), 20_000, world_size=2, ranks_on_node=2)
    assert len(problems) == 1
    text = str(problems[0])
    assert text.startswith("zero_optimization.offload_optimizer.nvme_path")
    assert f"{small_filesystem} has 65,536 bytes free" in text and "need at least 240,000" in text


def test_what_fits_and_what_is_counted(small_filesystem):
    assert nvme_swap_problems(_config(small_filesystem), 2_000, world_size=2, ranks_on_node=2) == []  # 24 KB
    # lazyzero's 8-bit states: 6 bytes per parameter; SGD: the fp32 master only.
    eight_bit = _config(small_filesystem, lazyzero={"optimizer": {"enabled": True}})
    assert nvme_swap_problems(eight_bit, 10_000, world_size=1, ranks_on_node=1) == []  # 60 KB
    assert nvme_swap_problems(_config(small_filesystem, "SGD"), 16_000, world_size=1, ranks_on_node=1) == []
    assert nvme_swap_problems(_config(small_filesystem, "SGD"), 17_000, world_size=1, ranks_on_node=1) != []


def test_parameters_and_optimizer_in_one_folder_are_added_up(small_filesystem):
    config = _config(small_filesystem, "SGD", bf16={"enabled": True})
    config["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": str(small_filesystem)}
    # 10,000 x 2 (bf16 parameters) + 10,000 x 4 (fp32 master) = 60,000 fits; 11,000 does not.
    assert nvme_swap_problems(config, 10_000, world_size=1, ranks_on_node=1) == []
    [problem] = nvme_swap_problems(config, 11_000, world_size=1, ranks_on_node=1)
    assert "offload_param.nvme_path and zero_optimization.offload_optimizer.nvme_path" in str(problem)


def test_swap_files_of_an_earlier_run_count_as_room(small_filesystem):
    earlier = small_filesystem / "zero_stage_3" / "optimizer" / "rank0"
    earlier.mkdir(parents=True)
    (earlier / "swap.tensor.swp").write_bytes(bytes(40_000))
    assert nvme_swap_problems(_config(small_filesystem, "SGD"), 15_000, world_size=1, ranks_on_node=1) == []


def test_ranks_on_this_node_come_from_the_launcher(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_on_this_node(8) == 8
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert ranks_on_this_node(8) == 4


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_run_whose_swap_files_cannot_fit_stops_before_writing(small_filesystem):
    proc = run_distributed("deepspeed", 2, [str(WORKER), str(small_filesystem)], timeout=300)
    assert proc.returncode != 0
    assert "zero_optimization.offload_optimizer.nvme_path" in proc.stdout and "need at least" in proc.stdout, \
        proc.stdout[-4000:]
    assert "trained" not in proc.stdout
    assert [path for path in small_filesystem.rglob("*")] == []
