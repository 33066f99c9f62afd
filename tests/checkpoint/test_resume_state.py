"""docs/reliability.md, what is tested: a rank SIGKILLed with 8-bit Adam states, int8 gradients with
error feedback and lazy checkpoints on; the run resumed from its last committed checkpoint holds,
right after loading and at the end, exactly the state of an uninterrupted run at the same step.

Compared bit for bit on every rank, not only the losses: the parameters (this rank's ZeRO-3
partition), the optimizer's fp32 master weights and its state (8-bit codes and scales of both
moments, the step), the int8 error-feedback residuals, the RNG states (torch, numpy, Python's
random), the learning rate, DeepSpeed's step counter and the data position (the indices and token
ids of the next batch). The state is written by resume_state_worker.py, which runs lazyzero.train.
"""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lazyzero.checkpoint.folder_layout import read_latest
from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("resume_state_worker.py")
SAVE_EVERY = 4
STEPS = 12


def _config(tmp_path: Path) -> Path:
    """ZeRO-3 with int8 gradients and error feedback (cpu_demo_int8.json), 8-bit AdamW
    (cpu_demo_adam8bit.json) and lazy checkpoints (cpu_demo_lazy_ckpt.json)."""
    def section(name: str, key: str) -> dict:
        return json.loads((ROOT / "ds_configs" / name).read_text())["lazyzero"][key]

    config = json.loads((ROOT / "ds_configs" / "cpu_demo_int8.json").read_text())
    config["lazyzero"]["optimizer"] = section("cpu_demo_adam8bit.json", "optimizer")
    config["lazyzero"]["checkpoint"] = section("cpu_demo_lazy_ckpt.json", "checkpoint")
    path = tmp_path / "all_but_plan.json"
    path.write_text(json.dumps(config))
    return path


def _train(tmp_path: Path, name: str, config: Path, save_dir: Path, *extra: str, env=None):
    argv = [str(WORKER), str(tmp_path / f"{name}_state"), f"{SAVE_EVERY},{STEPS}", "--",
            "--deepspeed_config", str(config), "--model", "tiny", "--train-examples", "200",
            "--eval-problems", "0", "--output-dir", str(tmp_path / name), "--max-steps", str(STEPS),
            "--save-dir", str(save_dir), "--save-every", str(SAVE_EVERY), *extra]
    return run_distributed("deepspeed", 2, argv, cwd=ROOT, env=env, timeout=600)


def _losses(output_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def _differences(found, expected, where: str = "") -> list[str]:
    """Where `found` and `expected` (nested dicts, lists, tuples, tensors, arrays) differ, bit for bit."""
    if isinstance(expected, dict):
        if not isinstance(found, dict) or found.keys() != expected.keys():
            return [f"{where}: keys {sorted(found) if isinstance(found, dict) else found} != {sorted(expected)}"]
        return [d for key in expected for d in _differences(found[key], expected[key], f"{where}/{key}")]
    if isinstance(expected, (list, tuple)):
        if type(found) is not type(expected) or len(found) != len(expected):
            return [f"{where}: {type(found).__name__} of {len(found)} != {type(expected).__name__} of {len(expected)}"]
        return [d for i, (f, e) in enumerate(zip(found, expected)) for d in _differences(f, e, f"{where}[{i}]")]
    if torch.is_tensor(expected):
        same = (torch.is_tensor(found) and found.dtype == expected.dtype and found.shape == expected.shape
                and torch.equal(found, expected))
        return [] if same else [f"{where}: tensors differ"]
    if isinstance(expected, np.ndarray):
        return [] if np.array_equal(found, expected) and found.dtype == expected.dtype else [f"{where}: arrays differ"]
    return [] if found == expected else [f"{where}: {found!r} != {expected!r}"]


def _state(tmp_path: Path, run: str, label: str, rank: int) -> dict:
    return torch.load(tmp_path / f"{run}_state" / f"{label}_rank{rank}.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.multiproc
def test_rank_killed_with_every_per_rank_state_resumes_to_the_same_state(tmp_path):
    config = _config(tmp_path)
    full = _train(tmp_path, "full", config, tmp_path / "full_ckpt")
    assert full.returncode == 0, full.stdout[-4000:]

    # Rank 1 is SIGKILLed while it writes its first file of the second checkpoint (step 8): step 4's
    # is committed, step 8's never is.
    killed = _train(tmp_path, "killed", config, tmp_path / "ckpt", env={"LAZYZERO_FAILPOINT": "mid_file@1#2"})
    assert killed.returncode != 0, killed.stdout[-4000:]
    assert read_latest(tmp_path / "ckpt") == f"step{SAVE_EVERY}"
    assert not (tmp_path / "killed_state" / f"step{STEPS}_rank0.pt").exists(), "the run was not killed"

    resumed = _train(tmp_path, "resumed", config, tmp_path / "ckpt", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "full")[SAVE_EVERY:]

    for rank in (0, 1):
        expected = _state(tmp_path, "full", f"step{SAVE_EVERY}", rank)
        # What the comparison covers is really there: 8-bit states, residuals, every generator.
        assert any("m_codes" in state and "sqrt_v_scales" in state for state in expected["optimizer_state"])
        residuals = expected["error_feedback"]["residuals"]
        assert residuals and any(bool(r.abs().sum() > 0) for r in residuals)
        assert expected["step"] == expected["global_steps"] == SAVE_EVERY
        for label, step in ((f"resumed{SAVE_EVERY}", SAVE_EVERY), (f"step{STEPS}", STEPS)):
            found = _state(tmp_path, "resumed", label, rank)
            assert _differences(found, _state(tmp_path, "full", f"step{step}", rank)) == [], (label, rank)


def test_rng_state_round_trip_covers_numpy_and_python_random(tmp_path):
    """The per-rank RNG record restores every generator a training loop may draw from, and loads
    with weights_only (lazyzero/safe_load.py)."""
    from lazyzero.checkpoint.engine_hooks import restore_rng_state, rng_state

    torch.save(rng_state(), tmp_path / "rng.pt")
    drawn = (torch.rand(3), np.random.rand(3), np.random.randn(), random.random(), random.gauss(0, 1))
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(3), np.random.rand(3), np.random.randn(), random.random(), random.gauss(0, 1))
    assert _differences(again, drawn) == []
