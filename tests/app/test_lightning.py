"""lazyzero under Lightning: a plain `Trainer(strategy=DeepSpeedStrategy(config=...))` script with
`lazyzero.patch_deepspeed()` added (tests/app/lightning_worker.py), on 2 CPU ranks, with the shipped
ds_configs/cpu_hf_trainer.json less the values Lightning sets itself. Real processes, no mocks.

Lightning's DeepSpeedStrategy runs on CUDA only: `setup_environment` refuses the CPU accelerator
before DeepSpeed is reached. The runs here use the same strategy with that one check taken out
(`CpuDeepSpeedStrategy` in the worker), the nearest path that runs on this machine
(docs/trainers.md)."""

import json
from pathlib import Path

import pytest

from lazyzero.testing import run_distributed

pytest.importorskip("lightning")

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[1] / "ds_configs" / "cpu_hf_trainer.json"
WORKER = str(HERE / "lightning_worker.py")
STEPS = 6  # lightning_worker.py saves every 2 steps: at 2, 4 and 6
NONZERO = ("optimizer_state_bytes", "grad_wire_bytes")


def lightning_config(tmp_path: Path) -> Path:
    """The shipped config as a Lightning user writes it: Lightning sets the batch size and the
    accumulation steps itself and refuses gradient_accumulation_steps in the file; nothing fills in
    the Trainer's "auto" values, so the optimizer's are given."""
    config = json.loads(SHIPPED.read_text())
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        config.pop(key)
    config["gradient_clipping"] = 1.0
    config["optimizer"]["params"].update(lr=2e-3, weight_decay=0.0)
    config["csv_monitor"]["output_path"] = str(tmp_path / "csv")
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def run_worker(out: Path, *extra: str, env: dict | None = None):
    out.mkdir(parents=True, exist_ok=True)
    return run_distributed("deepspeed", 2, [WORKER, str(out), *extra], timeout=300, env=env)


def result_of(out: Path, *extra: str) -> dict:
    proc = run_worker(out, *extra)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    config = lightning_config(out)
    return out, config, result_of(out / "whole", str(config), str(STEPS))


def test_lightnings_deepspeed_strategy_refuses_cpu_ranks_before_deepspeed(tmp_path):
    import torch
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies import DeepSpeedStrategy

    # The first thing Trainer.fit asks of the strategy, here without a Trainer around it.
    strategy = DeepSpeedStrategy(accelerator=CPUAccelerator(), config=str(lightning_config(tmp_path)))
    with pytest.raises(RuntimeError, match="^The DeepSpeed strategy is only supported on CUDA GPUs but "
                                           "`CPUAccelerator` is used.$"):
        strategy.setup_environment()
    assert not torch.distributed.is_initialized()


@pytest.mark.multiproc
@pytest.mark.slow  # 15 s for the uninterrupted run it shares, 60 s on two busy cores
def test_lightning_builds_a_lazyzero_engine_with_every_feature_on(whole_run):
    out, _, result = whole_run
    assert result["engine_class"] == "LazyZeroEngine" and result["is_lazyzero"]
    assert result["features"] == ["gradients", "optimizer", "checkpoint"]
    assert result["optimizer_class"] == "AdamW8bit"
    assert [entry["step"] for entry in result["metrics"]] == list(range(1, STEPS + 1))
    for key in NONZERO:
        assert result["metrics"][-1][key] > 0, (key, result["metrics"][-1])
    assert result["metrics"][-1]["grad_wire_bytes"] < 0.3 * result["metrics"][-1]["grad_fp32_wire_bytes"]
    # Lightning saves through engine.save_checkpoint(folder, tag="checkpoint"): one lazy checkpoint a folder.
    assert result["after_commit"]["checkpoint_tag"] == "checkpoint" and result["after_commit"]["checkpoint_bytes"] > 0
    assert result["checkpoints"] == ["epoch=1-step=2.ckpt", "epoch=3-step=4.ckpt", "epoch=5-step=6.ckpt"]
    assert all(b < a for a, b in zip(result["losses"], result["losses"][1:])), result["losses"]
    assert (out / "csv" / "lazyzero" / "lazyzero_grad_wire_bytes.csv").exists()


@pytest.mark.multiproc
@pytest.mark.slow  # 30 s, 105 s on two busy cores
def test_a_lightning_run_killed_during_a_background_write_resumes_from_the_last_committed_checkpoint(whole_run):
    """The run is SIGKILLed in the middle of writing the checkpoint of step 4 (LAZYZERO_FAILPOINT).
    Lightning itself refuses that folder (no committed tag folder in it); resumed from step 2's with
    `fit(ckpt_path=...)`, the losses from step 3 on equal the uninterrupted run's."""
    from lightning.fabric.strategies.deepspeed import _validate_checkpoint_directory

    from lazyzero.checkpoint.manifest import committed_tags

    root, config, whole = whole_run
    out = root / "killed"
    killed = run_worker(out, str(config), str(STEPS), env={"LAZYZERO_FAILPOINT": "mid_file@0#2"})
    assert killed.returncode != 0 and not (out / "result.json").exists()
    folders = sorted((out / "lightning").iterdir())
    assert [folder.name for folder in folders] == ["epoch=1-step=2.ckpt", "epoch=3-step=4.ckpt"]
    assert [committed_tags(folder) for folder in folders] == [["checkpoint"], []]
    with pytest.raises(FileNotFoundError, match="not a valid DeepSpeed checkpoint"):
        _validate_checkpoint_directory(folders[1])

    resumed = result_of(out, str(config), str(STEPS), "resume", str(folders[0]))
    assert [entry["step"] for entry in resumed["metrics"]] == [3, 4, 5, 6]
    assert resumed["losses"] == whole["losses"][2:], (resumed["losses"], whole["losses"])


@pytest.mark.multiproc
@pytest.mark.slow  # 2 runs: 60 s, 200 s on two busy cores
def test_ckpt_path_last_resumes_from_the_last_committed_checkpoint_after_a_kill(whole_run):
    """ModelCheckpoint(save_last="link") links last.ckpt to each folder right after the save call returns, and
    the run is SIGKILLed in the middle of writing step 4's checkpoint. `fit(ckpt_path="last")` resumes from
    step 2's folder, the newest committed one (checkpoint/lightning_folders.py), not from the uncommitted
    folder last.ckpt may name, and the losses from step 3 on equal the uninterrupted run's."""
    from lazyzero.checkpoint.trainer_folders import holds_uncommitted_checkpoint

    root, config, whole = whole_run
    out = root / "killed-last"
    killed = run_worker(out, str(config), str(STEPS), "last", env={"LAZYZERO_FAILPOINT": "mid_file@0#2"})
    assert killed.returncode != 0 and not (out / "result.json").exists()
    folder = out / "lightning"
    assert sorted(path.name for path in folder.iterdir()) == ["epoch=1-step=2.ckpt", "epoch=3-step=4.ckpt",
                                                              "last.ckpt"]
    assert holds_uncommitted_checkpoint(folder / "epoch=3-step=4.ckpt")

    resumed = result_of(out, str(config), str(STEPS), "last")
    assert resumed["resumed_from"] == "epoch=1-step=2.ckpt"
    assert [entry["step"] for entry in resumed["metrics"]] == [3, 4, 5, 6]
    assert resumed["losses"] == whole["losses"][2:], (resumed["losses"], whole["losses"])
