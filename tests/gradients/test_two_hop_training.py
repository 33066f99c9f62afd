"""Training with the two-hop int8 exchange on 2 "nodes" x 2 ranks (docs/gradients.md), through the entry point:
the layout taken from a real multi-node DeepSpeed launch, and set in the config under mpirun with a
hostfile."""

import json
import math
from pathlib import Path

import pytest

from lazyzero.testing import run_deepspeed_nodes, run_distributed

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "ds_configs"
TWO_HOPS = "int8 gradient exchange in two hops (2 nodes x 2 ranks"


def _train_argv(config: Path, output_dir: Path) -> list[str]:
    return ["--deepspeed_config", str(config), "--model", "tiny", "--train-examples", "200", "--eval-problems", "0",
            "--max-steps", "3", "--output-dir", str(output_dir)]


def _check_trained(output_dir: Path) -> None:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3]
    for record in records:
        assert math.isfinite(record["loss"]) and record["grad_overflow"] is False
        assert 0 < record["grad_wire_bytes"] <= 0.27 * record["grad_fp32_wire_bytes"]


# The two-hop exchange on 2 x 2 real ranks is in the default suite: tests/gradients/test_two_hop.py.
@pytest.mark.slow
@pytest.mark.multiproc
def test_layout_from_a_two_node_deepspeed_launch(tmp_path):
    # cpu_demo_int8.json leaves ranks_per_node null: the per-node launchers' LOCAL_SIZE decides.
    code, output = run_deepspeed_nodes(2, 2, ["--module", "lazyzero.train",
                                              *_train_argv(CONFIGS / "cpu_demo_int8.json", tmp_path)], cwd=ROOT,
                                       timeout=300)
    assert code == 0, output[-4000:]
    assert TWO_HOPS in output
    _check_trained(tmp_path)


@pytest.mark.slow  # mpirun with a hostfile runs in the default suite: tests/app/test_train_entry.py
@pytest.mark.multiproc
def test_layout_from_the_config_under_mpirun_with_a_hostfile_at_stage_2(tmp_path):
    # One host with 4 slots: mpirun sees one node; ranks_per_node 2 in the config rehearses two.
    # --map-by slot numbers ranks node by node (Open MPI 5's default mapping does not, and
    # DeepSpeed then stops on "LOCAL_RANK != OMPI_COMM_WORLD_LOCAL_RANK").
    config = json.loads((CONFIGS / "cpu_demo_int8_two_hop.json").read_text())
    config["zero_optimization"] = {"stage": 2, "contiguous_gradients": True}
    config_path = tmp_path / "zero2_two_hop.json"
    config_path.write_text(json.dumps(config))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    proc = run_distributed("mpirun", 4, ["-m", "lazyzero.train", *_train_argv(config_path, tmp_path / "run")],
                           cwd=ROOT, timeout=300,
                           launcher_args=("--hostfile", str(hostfile), "--map-by", "slot", "-x",
                                          "MASTER_ADDR=127.0.0.1"))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert TWO_HOPS in proc.stdout
    _check_trained(tmp_path / "run")
