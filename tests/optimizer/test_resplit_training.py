"""Training goes on where it stopped after a checkpoint is re-split for another number of ranks
(lazyzero/optimizer/reshard.py, zero3_reshard.py): the tiny preset with 8-bit AdamW, saved by 2
ranks after 2 steps, resumed on 1 rank with the same 8 sequences per step. The loss right after the
load depends only on the loaded weights; the next one also on the re-split moments (requantized at
new block edges) and on the restored lr, which a warm-up changes every step (a re-split once ran its
first step at the optimizer's initial lr, 0)."""

import json
import shutil
from pathlib import Path

import pytest

from lazyzero.testing import TOLERANCES, run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, stage: int, ranks: int) -> Path:
    config = {
        "train_micro_batch_size_per_gpu": 8 // ranks, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage, "contiguous_gradients": True, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
        "lazyzero": {"optimizer": {"enabled": True, "type": "adamw8bit", "min_8bit_size": 64}},
    }
    path = tmp_path / f"stage{stage}_{ranks}ranks.json"
    path.write_text(json.dumps(config))
    return path


def _train(tmp_path: Path, stage: int, ranks: int, name: str, save_dir: Path, *extra: str) -> list[float]:
    argv = ["--module", "lazyzero.train", "--deepspeed_config", str(_config(tmp_path, stage, ranks)), "--model", "tiny",
            "--seq-len", "48", "--train-examples", "64", "--eval-problems", "0", "--max-steps", "4",
            "--save-dir", str(save_dir), "--output-dir", str(tmp_path / name), *extra]
    proc = run_distributed("deepspeed", ranks, argv, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_a_run_resplit_from_two_ranks_to_one_continues_the_uninterrupted_losses(tmp_path, stage):
    uninterrupted = _train(tmp_path, stage, 2, "two_ranks", tmp_path / "saved", "--save-every", "2")
    resumed_dir = tmp_path / "resumed_ckpt"
    shutil.copytree(tmp_path / "saved" / "step2", resumed_dir / "step2")
    (resumed_dir / "latest").write_text("step2")
    resumed = _train(tmp_path, stage, 1, "one_rank", resumed_dir, "--resume")

    assert len(uninterrupted) == 4 and len(resumed) == 2
    assert resumed[0] == pytest.approx(uninterrupted[2], rel=1e-5)
    # The step after the load moves the loss as the uninterrupted step did (by about 0.1 here).
    assert abs(uninterrupted[3] - uninterrupted[2]) > 0.05
    assert resumed[1] == pytest.approx(uninterrupted[3], rel=TOLERANCES["reshard_requantization"] / 100)
