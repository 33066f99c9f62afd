"""`lazyzero.initialize` does not drift from `deepspeed.initialize`: the same parameters, and each
config-dependent step of DeepSpeed's either taken or refused before torch.distributed starts
(docs/deepspeed-internals.md, "`deepspeed.initialize` and `lazyzero.initialize`"). No processes."""

from __future__ import annotations

import argparse
import base64
import inspect
import json

import deepspeed
import pytest
import torch

import lazyzero
from lazyzero.config import LazyZeroConfigError, validate_ds_config
from lazyzero.engine import initialize as engine_initialize
from lazyzero.engine.deepspeed_route import initialize_from_any_caller

ALL_ON = {"gradients": {"enabled": True}, "optimizer": {"enabled": True}, "checkpoint": {"enabled": True}}


def parameters_of(function) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("ours", [lazyzero.initialize, engine_initialize.initialize, initialize_from_any_caller],
                         ids=["lazyzero.initialize", "engine.initialize", "patched deepspeed.initialize"])
def test_initialize_takes_deepspeed_initializes_parameters_names_kinds_and_defaults(ours):
    # DeepSpeed's own function, also while another test has it routed.
    theirs = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
    assert parameters_of(ours) == parameters_of(theirs)


def a_config(**top) -> dict:
    return {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2}, **top}


def only_problem(ds_config: dict) -> str:
    with pytest.raises(LazyZeroConfigError) as caught:
        validate_ds_config(ds_config)
    assert len(caught.value.problems) == 1, caught.value.problems
    return caught.value.problems[0]


@pytest.mark.parametrize("section", [ALL_ON, {}], ids=["capabilities on", "capabilities off"])
def test_the_hybrid_engine_is_refused_naming_the_key_and_the_way_to_it(section):
    problem = only_problem(a_config(hybrid_engine={"enabled": True}, lazyzero=section))
    assert problem.startswith("hybrid_engine.enabled: got true; allowed: false (DeepSpeed's hybrid engine")
    assert "deepspeed.initialize and a config without a \"lazyzero\" section" in problem
    validate_ds_config(a_config(hybrid_engine={"enabled": False}, lazyzero=section))


def test_autotp_is_refused_with_a_capability_on_and_taken_as_deepspeed_takes_it_with_every_one_off():
    problem = only_problem(a_config(tensor_parallel={"autotp_size": 2}, lazyzero={"gradients": {"enabled": True}}))
    assert problem == ("tensor_parallel.autotp_size: got 2; allowed: 0 or 1 while a lazyzero capability is on "
                       "(on: lazyzero.gradients; none handles AutoTP's tensor-parallel shards: switch them off to "
                       "train with AutoTP as plain DeepSpeed)")
    validate_ds_config(a_config(tensor_parallel={"autotp_size": 2}, lazyzero={}))
    validate_ds_config(a_config(tensor_parallel={"autotp_size": 1}, lazyzero=ALL_ON))


def test_a_pipeline_model_is_refused_before_torch_distributed_starts():
    from deepspeed.pipe import PipelineModule

    # Only the class matters to the refusal; a real PipelineModule needs torch.distributed to be built.
    model = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(model)
    with pytest.raises(ValueError, match="lazyzero does not support PipelineModule models"):
        lazyzero.initialize(model=model, config=a_config(lazyzero=ALL_ON))
    assert not torch.distributed.is_initialized()


def test_the_deprecated_deepscale_config_is_read_and_moved_as_deepspeed_does():
    config = a_config(lazyzero=ALL_ON)
    args = argparse.Namespace(deepscale_config=config)
    assert engine_initialize._resolve_config(args, None) == config
    assert args.deepspeed_config is config and args.deepscale_config is None
    both = argparse.Namespace(deepspeed_config=config, deepscale_config=config)
    with pytest.raises(ValueError, match="both deepspeed_config and the deprecated deepscale_config"):
        engine_initialize._resolve_config(both, None)


def test_a_base64_config_is_decoded_as_deepspeed_decodes_it():
    config = a_config(lazyzero=ALL_ON)
    encoded = base64.urlsafe_b64encode(json.dumps(config).encode()).decode()
    assert engine_initialize._resolve_config(None, encoded) == config
    with pytest.raises(LazyZeroConfigError, match="no such file; allowed: a JSON file"):
        engine_initialize._resolve_config(None, "missing.json")
