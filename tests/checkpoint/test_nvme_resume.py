"""Resuming a ZeRO-3 run whose parameters and optimizer state are swapped to NVMe is bit-exact
(lazyzero/checkpoint/nvme_restore.py): lazy checkpoints, 2 ranks, a model wide enough that every
large sub-group really goes through the swap files."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from lazyzero.checkpoint.nvme_restore import replay_cpu_adam_bias_correction
from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
STEPS, SAVE_EVERY = 24, 4
# One layer, hidden 1024: each rank's sub-groups of ~1M elements exceed the 1 MiB aio block and are
# swapped; the small one (norms, embeddings) stays in memory, so both restore paths are exercised.
WIDE_MODEL = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 1,
              "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 300, "max_position_embeddings": 256}
BETAS = (0.9, 0.95)

needs_libaio = pytest.mark.skipif(not Path("/usr/include/libaio.h").exists(),
                                  reason="NVMe offload needs libaio-dev (.ci/run installs it)")


def nvme_config(nvme_path: Path) -> dict:
    offload = {"device": "nvme", "nvme_path": str(nvme_path), "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": 1e-3, "betas": list(BETAS), "eps": 1e-8, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR",
                      "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20}},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 1_000_000, "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "offload_param": {**offload, "buffer_count": 16, "buffer_size": 2_000_000, "max_in_cpu": 0},
            "offload_optimizer": {**offload, "buffer_count": 4},
        },
        "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True},
        "steps_per_print": 1_000_000,
        "lazyzero": {"checkpoint": {"enabled": True}},
    }


def train(run_dir: Path, save_dir: Path, *extra: str) -> list[float]:
    """lazyzero.train on 2 ranks with its own NVMe folder; the loss of each step it ran."""
    (run_dir / "nvme").mkdir(parents=True)
    config = run_dir / "ds_config.json"
    config.write_text(json.dumps(nvme_config(run_dir / "nvme")))
    model = run_dir / "model.json"
    model.write_text(json.dumps(WIDE_MODEL))
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(config), "--model", str(model),
            "--train-examples", "200", "--eval-problems", "0", "--max-steps", str(STEPS),
            "--output-dir", str(run_dir / "out"), "--save-dir", str(save_dir), *extra]
    proc = run_distributed("deepspeed", 2, argv, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:]
    lines = (run_dir / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """(save dir, losses) of an uninterrupted run saving every SAVE_EVERY steps."""
    run_dir = tmp_path_factory.mktemp("nvme_full")
    losses = train(run_dir, run_dir / "save", "--save-every", str(SAVE_EVERY))
    assert len(losses) == STEPS
    return run_dir / "save", losses


# Step 4: the first checkpoint. Step 12: the step after it (13) is one where CPU Adam's pow(0.95, t)
# and its running product differ in the last bit, so it also checks the bias-correction replay.
@pytest.mark.multiproc
@needs_libaio
# Both slow (the shared full run takes a minute): NVMe swapping itself is in the default suite
# (tests/engine/test_nvme_offload.py, tests/optimizer/test_nvme_8bit.py).
@pytest.mark.slow
@pytest.mark.parametrize("resume_step", [4, 12])
def test_resume_from_nvme_checkpoint_repeats_the_losses_bit_for_bit(full_run, resume_step, tmp_path):
    save_dir, full_losses = full_run
    resume_dir = tmp_path / "save"
    shutil.copytree(save_dir / f"step{resume_step}", resume_dir / f"step{resume_step}")
    (resume_dir / "latest").write_text(f"step{resume_step}")
    resumed = train(tmp_path / "run", resume_dir, "--resume")
    assert resumed == full_losses[resume_step:]


def cpu_adam_run(grads: list[torch.Tensor], resume_before: int | None, replay: bool) -> torch.Tensor:
    """Final parameter after stepping through `grads`, with the optimizer rebuilt from its state
    dict (as a resumed run does) before step `resume_before`."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, grads[0].numel()))
    optimizer = DeepSpeedCPUAdam([param], lr=1e-3, betas=BETAS, weight_decay=0.01)
    for index, grad in enumerate(grads):
        if index == resume_before:
            saved = copy.deepcopy(optimizer.state_dict())
            param = torch.nn.Parameter(param.detach().clone())
            optimizer = DeepSpeedCPUAdam([param], lr=1e-3, betas=BETAS, weight_decay=0.01)
            optimizer.load_state_dict(saved)
            if replay:
                replay_cpu_adam_bias_correction(optimizer)
        param.grad = grad.clone()
        optimizer.step()
    return param.detach()


def test_cpu_adam_resume_is_bit_exact_only_with_the_replay():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=generator) for _ in range(8)]
    uninterrupted = cpu_adam_run(grads, resume_before=None, replay=False)
    # Resuming before step 6: pow(0.95, 6) is one bit off the product 0.95**6 of the running run.
    assert not torch.equal(cpu_adam_run(grads, resume_before=5, replay=False), uninterrupted)
    assert torch.equal(cpu_adam_run(grads, resume_before=5, replay=True), uninterrupted)
