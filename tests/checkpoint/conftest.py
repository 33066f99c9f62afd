"""A real lazy checkpoint folder, written once per test session by a 2-rank training run.

Tests copy it (shutil.copytree) to their own tmp_path before changing anything in it. Helpers are
fixtures too: a test module importing `conftest` could get another folder's conftest module."""

import json
from pathlib import Path

import pytest

from lazyzero.checkpoint.durable_io import hash_file
from lazyzero.checkpoint.manifest import Manifest
from lazyzero.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
LAZY_CONFIG = ROOT / "ds_configs" / "cpu_demo_lazy_ckpt.json"
# The run behind `lazy_checkpoint_dir`; tests/checkpoint/ckpt_plain_ds_worker.py rebuilds its model
# from the same model and data arguments.
TRAIN_ARGV = ["--module", "lazyzero.train", "--deepspeed_config", str(LAZY_CONFIG), "--model", "tiny",
              "--train-examples", "200", "--eval-problems", "0"]
SAVED_TAGS = ["step2", "step4"]


def train(output_dir: Path, save_dir: Path, *extra: str, env: dict | None = None, rank_logs: Path | None = None):
    """lazyzero.train on 2 ranks; the CompletedProcess (output merged). With `rank_logs`, each rank's
    output goes to a file of its own there instead (the launcher's --enable_each_rank_log)."""
    argv = [*TRAIN_ARGV, "--output-dir", str(output_dir), "--save-dir", str(save_dir), *extra]
    launcher_args = ("--enable_each_rank_log", str(rank_logs)) if rank_logs else ()
    return run_distributed("deepspeed", 2, argv, timeout=300, cwd=ROOT, env=env, launcher_args=launcher_args)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def write_checkpoint(save_dir: Path, tag: str, files: dict[str, bytes], created_unix: float,
                     global_steps: int = 1, world_size: int = 1) -> Manifest:
    """A small hand-made committed checkpoint: `files` (relative path -> bytes) and their manifest."""
    tag_dir = save_dir / tag
    entries = {}
    for relpath, data in files.items():
        (tag_dir / relpath).parent.mkdir(parents=True, exist_ok=True)
        (tag_dir / relpath).write_bytes(data)
        entries[relpath] = {"size": len(data), "hash": hash_file(tag_dir / relpath)[1], "rank": 0}
    manifest = Manifest(tag=tag, world_size=world_size, global_steps=global_steps, files=entries,
                        created_unix=created_unix)
    manifest.write(tag_dir)
    return manifest


@pytest.fixture(scope="session")
def make_checkpoint():
    """write_checkpoint(save_dir, tag, files, created_unix, global_steps=1, world_size=1) -> Manifest."""
    return write_checkpoint


@pytest.fixture(scope="session")
def lazy_train():
    """train(output_dir, save_dir, *extra_args, env=None): the same training run, on 2 ranks."""
    return train


@pytest.fixture(scope="session")
def read_run_metrics():
    """read_metrics(output_dir): the records of OUTPUT_DIR/metrics.jsonl."""
    return read_metrics


@pytest.fixture(scope="session")
def lazy_run_dir(tmp_path_factory) -> Path:
    """The session's run folder: save/ (checkpoints step2, step4; 'latest' = step4) and run/metrics.jsonl."""
    run_dir = tmp_path_factory.mktemp("lazy_run")
    proc = train(run_dir / "run", run_dir / "save", "--max-steps", "4", "--save-every", "2")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert sorted(p.name for p in (run_dir / "save").iterdir() if p.is_dir()) == SAVED_TAGS
    return run_dir


@pytest.fixture(scope="session")
def lazy_checkpoint_dir(lazy_run_dir) -> Path:
    """The --save-dir of that run. Copy it before damaging anything."""
    return lazy_run_dir / "save"


@pytest.fixture(scope="session")
def lazy_run_metrics(lazy_run_dir) -> list[dict]:
    """metrics.jsonl of that run, one record per step (step, loss, ...)."""
    return read_metrics(lazy_run_dir / "run")
