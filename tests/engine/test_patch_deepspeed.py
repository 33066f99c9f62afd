"""`lazyzero.patch_deepspeed()` (lazyzero/engine/deepspeed_route.py): `deepspeed.initialize` builds a
LazyZeroEngine for a config with a "lazyzero" section, plain DeepSpeed's engine for any other; the
patch is declared, idempotent and undone by `unpatch_deepspeed`."""

import importlib.util
import inspect
import json
from pathlib import Path

import deepspeed
import pytest

import lazyzero
from lazyzero.engine.deepspeed_route import OWNER, initialize_from_any_caller
from lazyzero.patch_point import (
    PatchRefused,
    applied_patches,
    original_parameters,
    route_function,
    routed_to,
    unroute_function,
)
from lazyzero.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "patch_deepspeed_worker.py"


@pytest.fixture
def unpatched():
    yield
    lazyzero.unpatch_deepspeed()


def test_patch_routes_deepspeed_initialize_once_and_unpatch_restores_the_original(unpatched):
    original = deepspeed.initialize
    before = len(applied_patches())
    lazyzero.patch_deepspeed()
    routed = deepspeed.initialize
    lazyzero.patch_deepspeed()
    assert deepspeed.initialize is routed is not original
    assert routed_to(deepspeed, "initialize") is initialize_from_any_caller
    # With the trainers installed, their folder rules are routed too (checkpoint/trainer_folders.py), the
    # Trainer's default callbacks get the end-of-training one (checkpoint/trainer_end.py), and Accelerate's
    # count of CPU ranks is routed (engine/accelerate_ranks.py).
    lightning = [("lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._find_last_checkpoints", OWNER)]
    assert [(p.target, p.owner) for p in applied_patches()[before:]] == [
        ("deepspeed:initialize", OWNER), ("transformers.trainer_utils:get_last_checkpoint", OWNER),
        ("transformers.trainer:rotate_checkpoints", OWNER), ("transformers.trainer:DEFAULT_CALLBACKS", OWNER),
        *(lightning if importlib.util.find_spec("lightning") else []),  # an optional library (the trainers extra)
        ("accelerate.accelerator:Accelerator.load_state", OWNER),
        ("accelerate.state:PartialState._prepare_backend", OWNER)]
    from transformers import trainer

    from lazyzero.checkpoint.trainer_end import LazyCheckpointsCallback

    assert trainer.DEFAULT_CALLBACKS.count(LazyCheckpointsCallback) == 1
    # Callers see DeepSpeed's name, docstring and parameters; the internals check reads the original's.
    assert routed.__doc__ == original.__doc__ and inspect.signature(routed) == inspect.signature(original)
    assert original_parameters(routed) == original_parameters(original)
    assert lazyzero.unpatch_deepspeed() is True
    assert deepspeed.initialize is original and LazyCheckpointsCallback not in trainer.DEFAULT_CALLBACKS
    assert lazyzero.unpatch_deepspeed() is False


def test_another_routing_of_initialize_is_refused(unpatched):
    lazyzero.patch_deepspeed()

    def other(args, model, optimizer, model_parameters, training_data, lr_scheduler, distributed_port, mpu,
              dist_init_required, collate_fn, config, mesh_param, config_params):
        return None

    with pytest.raises(PatchRefused, match="already routed by lazyzero.patch_deepspeed"):
        route_function(deepspeed, "initialize", other, owner="someone else")
    lazyzero.unpatch_deepspeed()
    with pytest.raises(PatchRefused, match="takes \\('config',\\)"):
        route_function(deepspeed, "initialize", lambda config: None, owner="test")


@pytest.mark.multiproc
@pytest.mark.slow  # 45 s; the trainers' tests (tests/app/test_trainers.py) take the same route by default
def test_initialize_builds_lazyzero_engines_for_a_lazyzero_section_only(tmp_path):
    proc = run_distributed("deepspeed", 1, [str(WORKER), str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["before"] == result["plain"] == result["plain_params"] == result["after"] == "DeepSpeedEngine"
    assert (result["section"] == result["section_from_file"] == result["section_as_config_params"]
            == result["section_as_base64"] == "LazyZeroEngine")
    assert "lazyzero.optimizer.enabled: got 'yes'" in result["invalid"]
    assert result["unpatched"] is True


def test_only_the_owner_undoes_a_routing(unpatched):
    lazyzero.patch_deepspeed()
    with pytest.raises(PatchRefused, match="someone else undoes the routing of initialize"):
        unroute_function(deepspeed, "initialize", owner="someone else")
    assert routed_to(deepspeed, "initialize") is initialize_from_any_caller


def test_a_deepspeed_whose_initialize_takes_other_parameters_is_refused_naming_its_version(monkeypatch):
    monkeypatch.setattr(deepspeed, "initialize", lambda model=None, config=None: None)
    with pytest.raises(PatchRefused, match=f"takes \\('model', 'config'\\) in DeepSpeed {deepspeed.__version__}"):
        lazyzero.patch_deepspeed()
