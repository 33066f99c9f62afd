"""Planning models no rank holds whole (docs/plan.md, "Planning partitioned models"): the profiler
measures a model partitioned by `deepspeed.zero.Init`, or on the meta device, one layer at a time and
finds the sizes (and, with the same weights, the gradient errors) of the whole model; a planned
`lazyzero.initialize` trains a zero.Init model as it trains the whole one, with a layer's parameters
and optimizer state placed on NVMe."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lazyzero.distributed.launch import distributed_env, free_port
from lazyzero.plan.solver.problem import LayerPlan
from lazyzero.testing import run_distributed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def single_rank(script: Path, *args: str, timeout: float = 300) -> None:
    """`script` as rank 0 of a world of 1 (zero.Init needs a process group), in a process of its own."""
    env = {**distributed_env(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(script), *args], env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]


def test_a_partitioned_or_meta_model_profiles_like_the_whole_one(tmp_path):
    out = tmp_path / "profiles.json"
    single_rank(HERE / "partitioned_profile_worker.py", str(out))
    profiles = json.loads(out.read_text())
    whole, partitioned, meta = profiles["whole"], profiles["partitioned"], profiles["meta"]
    assert [layer["name"] for layer in whole] == ["model.layers.0", "model.layers.1", "embed_and_head"]
    sizes = ("measured_as", "tensors", "act_bytes", "input_bytes", "output_bytes")
    for form in (partitioned, meta):
        assert [{key: layer[key] for key in sizes} for layer in form] == \
            [{key: layer[key] for key in sizes} for layer in whole]
    # The same weights, gathered one layer at a time: the same gradients, bit for bit.
    assert [layer["grad_error"] for layer in partitioned] == [layer["grad_error"] for layer in whole]
    # Fresh weights on meta: errors of a randomly initialized model, of the same order.
    for found, reference in zip(meta[:2], whole[:2]):
        assert 0 < found["grad_error"]["8"] < 5 * reference["grad_error"]["8"]


# Wide enough that each rank's share of a weight reaches DeepSpeed's 1 MiB NVMe swap threshold in bf16.
MODEL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 300, "max_position_embeddings": 64}


def planned_config(tmp_path: Path) -> dict:
    from dataclasses import asdict

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # Layer 1's parameters and optimizer state on NVMe, the rest in memory: the placement a
    # zero.Init model gets only by having its partitions moved after construction.
    layers = [LayerPlan("keep", 16, "gpu", "gpu", "gpu", False), LayerPlan("keep", 16, "gpu", "nvme", "nvme", False),
              LayerPlan("keep", 16, "gpu", "gpu", "gpu", False)]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layers": [asdict(lp) for lp in layers], "act_transfers": [],
                                "checkpoint_transfers": [0.0] * 7, "predicted_step_s": 0.0, "predicted_peak_bytes": {},
                                "objective": 0.0, "source": "greedy", "status": "heuristic"}))
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 3}, "steps_per_print": 10**9,
            "lazyzero": {"plan": {"enabled": True, "seq_len": 32, "cpu_mem": 16 * 10**9, "nvme_path": str(nvme),
                                  "plan_path": str(plan), "profile_path": str(tmp_path / "profile.json"),
                                  "measure_steps": 100}}}


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_planned_run_trains_a_zero_init_model_as_the_whole_one(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(planned_config(tmp_path)))
    (tmp_path / "model.json").write_text(json.dumps(MODEL))
    argv = [str(HERE / "partitioned_worker.py"), str(tmp_path), str(tmp_path / "config.json"),
            str(tmp_path / "model.json")]
    proc = run_distributed("deepspeed", 2, argv, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:]
    for rank in range(2):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())
        partitioned, whole = runs["partitioned"], runs["whole"]
        assert not partitioned["held_whole"] and whole["held_whole"]
        assert partitioned["param_bytes"] == whole["param_bytes"]
        # Layer 1's bf16 partitions and fp32 state went to NVMe, the rest stayed in memory, alike.
        assert partitioned["tiers"] == whole["tiers"]
        assert partitioned["tiers"]["param_nvme_elements"] > 0 and partitioned["tiers"]["param_memory_elements"] > 0
        assert partitioned["losses"] == whole["losses"]
