"""lazyzero under the trainers people already use: a plain Hugging Face Trainer script and a plain
Accelerate script, each with `lazyzero.patch_deepspeed()` added, on 2 CPU ranks, with the shipped
ds_configs/cpu_hf_trainer.json (int8 gradients, 8-bit AdamW, lazy checkpoints, csv_monitor, "auto"
values the trainers fill in). Real processes, no mocks."""

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from lazyzero.checkpoint.folder_layout import temp_dir
from lazyzero.checkpoint.trainer_folders import holds_uncommitted_checkpoint
from lazyzero.testing import run_distributed

HERE = Path(__file__).resolve().parent
SHIPPED = HERE.parents[1] / "ds_configs" / "cpu_hf_trainer.json"
STEPS = 5
# Metrics every optimizer step of this config reports; the checkpoint ones follow the first commit.
EVERY_STEP = ("optimizer_state_bytes", "grad_wire_bytes", "grad_fp32_wire_bytes", "grad_exchange_s", "grad_overflow")
NONZERO = ("optimizer_state_bytes", "grad_wire_bytes", "checkpoint_bytes")


def config_copy(tmp_path: Path, **changes) -> Path:
    """The shipped config with its csv_monitor writing under `tmp_path`, and `changes` (None: remove the key)."""
    config = json.loads(SHIPPED.read_text())
    config["csv_monitor"]["output_path"] = str(tmp_path / "csv")
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def run_worker(worker: str, out: Path, config: Path, *extra: str, env: dict | None = None) -> dict:
    proc = run_distributed("deepspeed", 2, [str(HERE / worker), str(out), str(config), *extra], timeout=300,
                           env=env)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads((out / "result.json").read_text())


def rank_outputs(worker: str, out: Path, config: Path, *extra: str) -> tuple[int, str, list[str]]:
    """A failing run's return code, the launcher's output and each rank's (the launcher's --enable_each_rank_log)."""
    logs = out / "rank_logs"
    proc = run_distributed("deepspeed", 2, [str(HERE / worker), str(out), str(config), *extra], timeout=300,
                           launcher_args=("--enable_each_rank_log", str(logs)))
    return proc.returncode, proc.stdout, [next(logs.glob(f"*_rank{rank}.log")).read_text() for rank in (0, 1)]


@pytest.fixture(scope="module")
def hf_trainer_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_trainer")
    return out, run_worker("hf_trainer_worker.py", out, config_copy(out))


def assert_lazyzero_features_on(result: dict, losses=None) -> None:
    assert result["engine_class"] == "LazyZeroEngine" and result["is_lazyzero"]
    assert result["features"] == ["gradients", "optimizer", "checkpoint"]
    assert result["optimizer_class"] == "AdamW8bit"
    metrics = result["metrics"]
    assert [entry["step"] for entry in metrics] == list(range(1, STEPS + 1))
    for key in NONZERO:
        assert metrics[-1][key] > 0, (key, metrics[-1])
    # int8 on the wire: about a quarter of what fp32 buckets would send.
    assert metrics[-1]["grad_wire_bytes"] < 0.3 * metrics[-1]["grad_fp32_wire_bytes"]
    losses = list(result["losses"] if losses is None else losses)
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.multiproc
def test_hf_trainer_builds_a_lazyzero_engine_with_every_feature_on(hf_trainer_run):
    _, result = hf_trainer_run
    assert_lazyzero_features_on(result)
    # save_total_limit 1: the newest, and the one before it when the newest was still being written at
    # rotation (an uncommitted folder does not count toward the limit: docs/checkpoint.md, "Under the Trainer").
    assert result["checkpoints"] in ([f"checkpoint-{STEPS}"], [f"checkpoint-{STEPS - 1}", f"checkpoint-{STEPS}"])
    # TrainerLogsCallback: every log entry of the Trainer's history holds the step's lazyzero metrics,
    # and the step's time.
    assert [entry["step"] for entry in result["logged"]] == list(range(1, STEPS + 1))
    for entry, recorded in zip(result["logged"], result["metrics"]):
        assert all(f"lazyzero/{key}" in entry for key in EVERY_STEP + ("step_s",)), entry
        assert entry["lazyzero/grad_wire_bytes"] == recorded["grad_wire_bytes"]  # the same on every rank
    assert all(result["logged"][-1][f"lazyzero/{key}"] > 0 for key in NONZERO), result["logged"][-1]
    # patch_deepspeed() shared the cores among the 2 ranks (Accelerate would give each rank all of them).
    assert result["threads"] == max(1, os.cpu_count() // 2)


@pytest.mark.multiproc
def test_csv_monitor_has_one_file_per_lazyzero_metric_with_a_row_per_step(hf_trainer_run):
    out, result = hf_trainer_run
    folder = out / "csv" / "lazyzero"
    reported = {key for entry in result["metrics"] for key in entry if key not in ("step", "checkpoint_tag")}
    written = {path.stem.removeprefix("lazyzero_") for path in folder.glob("lazyzero_*.csv")}
    assert written == reported
    for key in EVERY_STEP:
        with open(folder / f"lazyzero_{key}.csv") as file:
            rows = list(csv.reader(file))
        assert rows[0] == ["step", key]
        assert [int(step) for step, _ in rows[1:]] == list(range(1, STEPS + 1)), (key, rows)
    with open(folder / "lazyzero_grad_wire_bytes.csv") as file:
        # Every rank sends as many int8 bytes; the value written is the mean over the ranks.
        assert {float(value) for _, value in list(csv.reader(file))[1:]} == {result["metrics"][0]["grad_wire_bytes"]}


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate")
    return out, run_worker("accelerate_worker.py", out, config_copy(out))


@pytest.mark.multiproc
def test_accelerate_script_builds_a_lazyzero_engine_with_every_feature_on(accelerate_run):
    out, result = accelerate_run
    assert_lazyzero_features_on(result, losses=result["ranks"][0]["losses"].values())
    assert result["checkpoints"] == ["checkpoint_0", "checkpoint_1"]
    assert (out / "csv" / "lazyzero" / "lazyzero_grad_wire_bytes.csv").exists()


@pytest.mark.multiproc
def test_accelerate_on_cpu_ranks_trains_each_rank_on_its_own_shard_and_saves_every_ranks_random_state(
        accelerate_run):
    """Accelerate counts both ranks (engine/accelerate_ranks.py): the "auto" train_batch_size is filled in for
    2 ranks (DeepSpeed's batch check passes), each rank trains on other batches, and each rank's random state
    is saved in a file of its own."""
    _, result = accelerate_run
    assert result["num_processes"] == 2
    rank0, rank1 = result["ranks"]
    assert all(rank0["batch_sums"][step] != rank1["batch_sums"][step] for step in rank0["batch_sums"]), result["ranks"]
    assert all(rank0["losses"][step] != rank1["losses"][step] for step in rank0["losses"])
    assert result["random_states"] == [f"checkpoint_{i}/random_states_{rank}.pkl" for i in (0, 1) for rank in (0, 1)]


@pytest.mark.multiproc
def test_accelerate_load_state_resumes_every_rank_from_the_newest_committed_folder(accelerate_run, tmp_path):
    """`load_state()` of the newest folder, when that folder's lazy checkpoint was never committed (as a
    run killed while writing it leaves it: Accelerate's files beside a temporary tag folder), loads the
    one before (checkpoint/accelerate_folders.py); every rank gets its own random state back, and each
    rank's losses go on as in the uninterrupted run."""
    out, whole = accelerate_run
    shutil.copytree(out / "checkpoints", tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "checkpoint_1" / "pytorch_model").rename(
        temp_dir(tmp_path / "checkpoints" / "checkpoint_1", "pytorch_model"))
    assert holds_uncommitted_checkpoint(tmp_path / "checkpoints" / "checkpoint_1")

    resumed = run_worker("accelerate_worker.py", tmp_path, config_copy(tmp_path), "resume")
    for before, after in zip(whole["ranks"], resumed["ranks"]):
        assert list(after["draws"]) == ["2", "4"] and after["draws"]["2"] == before["draws"]["2"]
        assert after["losses"] == {step: loss for step, loss in before["losses"].items() if int(step) > 2}
    assert resumed["ranks"][0]["draws"]["2"] != resumed["ranks"][1]["draws"]["2"]


@pytest.mark.multiproc
def test_an_accelerator_built_before_the_patch_is_refused_in_one_line_saying_how_to_launch(tmp_path):
    """Built before `lazyzero.patch_deepspeed()`, Accelerate counts one process on CPU ranks; lazyzero refuses
    to build its engine under it (engine/accelerate_ranks.py), and the refusal reads once from the launcher's
    view, as rank 0's last line (distributed/refusal_line.py)."""
    code, launcher, (rank0, rank1) = rank_outputs("accelerate_worker.py", tmp_path, config_copy(tmp_path),
                                                  "patch-late")
    assert code != 0 and not (tmp_path / "result.json").exists()
    refusal = rank0.strip().splitlines()[-1]
    assert refusal.startswith("lazyzero: LaunchRefused: Accelerate counts 1 process(es) but the job has 2 ranks, "
                              "so every rank would train on the same batches"), rank0[-3000:]
    assert refusal.endswith("Call lazyzero.patch_deepspeed() before the script builds its Accelerator (or any "
                            "PartialState), and launch with: deepspeed --num_gpus N script.py")
    assert rank1.strip().splitlines()[-1] == ("lazyzero: rank 1 stopped on the same refusal as rank 0 "
                                              "(LaunchRefused); rank 0 prints it"), rank1[-3000:]
    assert (launcher + rank0 + rank1).count("Accelerate counts 1 process(es)") == 1


@pytest.mark.multiproc
def test_an_optimizer_from_code_is_refused_naming_the_way_to_the_8bit_one(tmp_path):
    result = run_worker("accelerate_worker.py", tmp_path, config_copy(tmp_path, optimizer=None),
                        "torch-optimizer")
    refusal = result["refusal"]
    assert "lazyzero.optimizer.enabled is true, but an optimizer object (AdamW) came from code" in refusal
    assert "\"optimizer\" section" in refusal and "accelerate.utils.DummyOptim" in refusal


@pytest.mark.multiproc
def test_tensorboard_event_file_has_the_lazyzero_tags(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed here; DeepSpeed's TensorBoard "
                                              "monitor needs it (the CSV test above checks the same events)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tensorboard = {"enabled": True, "output_path": str(tmp_path / "tensorboard"), "job_name": "lazyzero"}
    result = run_worker("hf_trainer_worker.py", tmp_path, config_copy(tmp_path, tensorboard=tensorboard))
    events = EventAccumulator(str(tmp_path / "tensorboard" / "lazyzero"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"lazyzero/{key}" for key in EVERY_STEP} <= tags, tags
    assert [event.step for event in events.Scalars("lazyzero/grad_wire_bytes")] == list(range(1, STEPS + 1))
    assert result["is_lazyzero"]


RESUME_STEPS = 6  # saves at steps 2, 4 and 6


# A kill mid-write leaves the previous checkpoint in the default suite: tests/checkpoint/test_crash_failpoints.py.
@pytest.mark.slow
@pytest.mark.multiproc
def test_a_trainer_run_killed_during_a_background_write_resumes_from_the_last_committed_checkpoint(tmp_path):
    """save_steps 2, save_total_limit 1: the run is SIGKILLed in the middle of writing the checkpoint of
    step 4 (LAZYZERO_FAILPOINT). Rotation kept a committed folder after every save. A restart with
    resume_from_checkpoint=True, and one that resumes as transformers' example scripts do (their
    `get_last_checkpoint`, bound at import, passed to train()), both pick checkpoint-2, not the uncommitted
    checkpoint-4, and their losses from step 3 on equal an uninterrupted run's."""
    whole = run_worker("hf_trainer_worker.py", tmp_path / "whole", config_copy(_made(tmp_path / "whole")),
                       str(RESUME_STEPS))
    # Right after the first save nothing is committed yet; after every later one some folder is.
    assert whole["committed_at_save"][1:] == [True, True], whole["committed_at_save"]

    out = tmp_path / "killed"
    config = config_copy(_made(out))
    killed = run_distributed("deepspeed", 2, [str(HERE / "hf_trainer_worker.py"), str(out), str(config),
                                              str(RESUME_STEPS)],
                             timeout=300, env={"LAZYZERO_FAILPOINT": "mid_file@0#2"})
    assert killed.returncode != 0 and not (out / "result.json").exists()
    folders = sorted(p.name for p in (out / "trainer").glob("checkpoint-*"))
    assert folders == ["checkpoint-2", "checkpoint-4"], folders  # rotation waited for step 4's commit
    assert holds_uncommitted_checkpoint(out / "trainer" / "checkpoint-4")
    example = shutil.copytree(out, tmp_path / "example")

    expected = {step: loss for step, loss in zip(whole["loss_steps"], whole["losses"]) if step > 2}
    for folder, mode in ((out, "resume"), (example, "example")):
        resumed = run_worker("hf_trainer_worker.py", folder, config, str(RESUME_STEPS), mode)
        assert resumed["resumed_from"] == "checkpoint-2", mode
        assert all(resumed["committed_at_save"]), resumed["committed_at_save"]  # checkpoint-2 was there throughout
        after = {step: loss for step, loss in zip(resumed["loss_steps"], resumed["losses"]) if step > 2}
        assert list(after) == [3, 4, 5, 6] and after == expected, (mode, after, expected)


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder
