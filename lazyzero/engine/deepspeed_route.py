"""`lazyzero.patch_deepspeed()`: `deepspeed.initialize`, wherever it is called from, builds a
`LazyZeroEngine` when its config has a "lazyzero" section.

The Hugging Face Trainer (through Accelerate), Accelerate scripts and Lightning call
`deepspeed.initialize` themselves, from the user's DeepSpeed JSON, after filling in its "auto"
values; they look the function up on the module at each call, so routing the module attribute
reaches all of them (docs/patch-point.md). A config
without the section goes to DeepSpeed's own function untouched, so such runs are plain DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from lazyzero.distributed.cpu_threads import share_cpu_cores
from lazyzero.engine.accelerate_ranks import route_accelerate_rank_count, unroute_accelerate_rank_count
from lazyzero.engine.deepspeed_args import DEEPSPEED_DEFAULT_PORT, config_in_args
from lazyzero.feature import Feature

OWNER = "lazyzero.patch_deepspeed"
SECTION = "lazyzero"


def patch_deepspeed() -> None:
    """Route `deepspeed.initialize` to `initialize_from_any_caller`, and with it what each capability
    changes in the installed trainers (`Feature.patch_trainers`: the checkpoint-folder rules) and
    Accelerate's count of CPU ranks (engine/accelerate_ranks.py); on CPU ranks it shares the host's
    cores among them (distributed/cpu_threads.py), and it clears the build locks killed jobs left
    (ops/stale_locks.py), before DeepSpeed loads its first op. Calling it again does nothing."""
    import deepspeed

    from lazyzero.engine.features import call_on_classes
    from lazyzero.ops.stale_locks import clear_stale_build_locks
    from lazyzero.patch_point import route_function

    route_function(deepspeed, "initialize", initialize_from_any_caller, owner=OWNER)
    call_on_classes(Feature.patch_trainers)
    route_accelerate_rank_count()
    share_cpu_cores()
    clear_stale_build_locks()


def unpatch_deepspeed() -> bool:
    """Give `deepspeed.initialize` back DeepSpeed's own function; whether it was routed."""
    import deepspeed

    from lazyzero.engine.features import call_on_classes
    from lazyzero.patch_point import unroute_function

    call_on_classes(Feature.unpatch_trainers)
    unroute_accelerate_rank_count()
    return unroute_function(deepspeed, "initialize", owner=OWNER)


def initialize_from_any_caller(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                               lr_scheduler=None, distributed_port=DEEPSPEED_DEFAULT_PORT, mpu=None,
                               dist_init_required=None, collate_fn=None, config=None, mesh_param=None,
                               config_params=None):
    """`deepspeed.initialize` once patched: `lazyzero.initialize` for a config with a "lazyzero"
    section (validated as there), DeepSpeed's own function, with the caller's arguments as given,
    for any other config."""
    import deepspeed

    arguments = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                     training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port,
                     mpu=mpu, dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                     mesh_param=mesh_param, config_params=config_params)
    given = config if config is not None else config_params
    ds_config = _readable_config(args, given)
    if not has_lazyzero_section(ds_config):
        # DeepSpeed's own function, also when called through a reference kept from before an unpatch.
        original = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
        return original(**arguments)
    from lazyzero.engine.initialize import initialize

    return initialize(**arguments)


def has_lazyzero_section(ds_config: Any) -> bool:
    return isinstance(ds_config, dict) and SECTION in ds_config


def _readable_config(args: Any, config: Any) -> Any:
    """The config dict the call names (a dict, a path, base64 JSON, or args.deepspeed_config), read
    as DeepSpeed reads it; None when it cannot be read, so that DeepSpeed's own errors are raised."""
    if config is None:
        try:
            config = config_in_args(args)
        except ValueError:
            return None  # DeepSpeed's initialize refuses both names itself
    if config is None or isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    try:
        return load_ds_config(config)
    except Exception:  # noqa: BLE001 - DeepSpeed raises its own, clearer error when it reads it again
        return None
