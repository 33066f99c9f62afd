"""Checkpoint files load without running code (lazyzero/safe_load.py, docs/reliability.md):
every type DeepSpeed's own files hold is allowlisted, anything else is refused before it runs,
and `allow_pickle` is the explicit opt-out."""

import os
from pathlib import Path

import pytest
import torch

from lazyzero.config import validate_ds_config
from lazyzero.safe_load import (
    OPT_OUT_KEY,
    UnsafeCheckpointFile,
    allowed_types,
    load_checkpoint_file,
)
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "safe_load_worker.py"


class RunsCode:
    """Unpickling this calls the function its __reduce__ names: here, `open` creating a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


class Harmless:
    def __init__(self, value: int):
        self.value = value


def test_a_file_that_would_run_code_is_refused_naming_the_file_the_call_and_the_opt_out(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / "hostile.pt"
    torch.save({"weights": torch.ones(3), "payload": RunsCode(marker)}, path)

    with pytest.raises(UnsafeCheckpointFile) as refused:
        load_checkpoint_file(path, "cpu")
    message = str(refused.value)
    assert str(path) in message and "io.open" in message and OPT_OUT_KEY in message
    assert not marker.exists()


def test_allow_pickle_loads_what_the_default_refuses(tmp_path):
    path = tmp_path / "custom.pt"
    torch.save({"weights": torch.arange(3), "extra": Harmless(7)}, path)
    with pytest.raises(UnsafeCheckpointFile, match="Harmless"):
        load_checkpoint_file(path)
    loaded = load_checkpoint_file(path, allow_pickle=True)
    assert loaded["extra"].value == 7 and torch.equal(loaded["weights"], torch.arange(3))


def test_tensors_containers_and_numbers_load_as_saved(tmp_path):
    path = tmp_path / "plain.pt"
    saved = {"w": torch.randn(4, 4), "step": 3, "names": ["a", "b"], "nested": {"lr": 0.1, "flag": None}}
    torch.save(saved, path)
    loaded = load_checkpoint_file(path, "cpu", mmap=True)
    assert torch.equal(loaded["w"], saved["w"]) and loaded["names"] == ["a", "b"] and loaded["nested"]["flag"] is None


def test_the_opt_out_is_a_checkpoint_key_off_by_default():
    base = {"train_micro_batch_size_per_gpu": 1}
    assert validate_ds_config({**base, "lazyzero": {"checkpoint": {"enabled": True}}}).checkpoint.allow_pickle is False
    config = validate_ds_config({**base, "lazyzero": {"checkpoint": {"enabled": True, "allow_pickle": True}}})
    assert config.checkpoint.allow_pickle is True


@pytest.fixture(scope="module")
def deepspeed_checkpoints(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plain_deepspeed")
    proc = run_distributed("deepspeed", 1, [str(WORKER), str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return out


@pytest.mark.multiproc
def test_every_file_plain_deepspeed_saves_needs_only_allowlisted_types(deepspeed_checkpoints):
    allowed = {f"{t.__module__}.{t.__qualname__}" for t in allowed_types()}
    files = sorted(deepspeed_checkpoints.rglob("*.pt"))
    layouts = {path.relative_to(deepspeed_checkpoints).parts[0] for path in files}
    skipped = (deepspeed_checkpoints / "skipped.txt").read_text().split()  # fp16 where the CPU lacks it
    assert len(layouts) == 7 - len(skipped) and len(files) >= 11 - 2 * len(skipped)  # stage 0: one file
    needed = set()
    for path in files:
        needed.update(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        load_checkpoint_file(path, "cpu")
    assert needed <= allowed, needed - allowed
    # The allowlist holds nothing DeepSpeed does not need (each entry is seen in some layout; the
    # dynamic loss scaler only in the fp16 one).
    if skipped:
        allowed.discard("deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler")
    assert needed == allowed, allowed - needed


def test_refusal_is_raised_before_any_global_is_resolved(tmp_path, monkeypatch):
    """Even a global that names an importable function is never imported or called."""
    marker = tmp_path / "marker"
    path = tmp_path / "hostile.pt"
    torch.save([RunsCode(marker)], path)
    calls = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(args))
    with pytest.raises(UnsafeCheckpointFile):
        load_checkpoint_file(path)
    assert not marker.exists() and not calls
