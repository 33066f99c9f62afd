"""lazyzero: memory planning, quantization, 8-bit optimizers and lazy checkpoints for DeepSpeed ZeRO.

Importing lazyzero never compiles anything and never imports DeepSpeed: `initialize` and
`patch_deepspeed` import the engine when they are called, and `LazyZeroEngine` is resolved on first
use, so that `lazyzero config check` stays fast (docs/architecture.md).
"""

from lazyzero._lazy_names import lazy_names
from lazyzero._version import __version__
from lazyzero.engine import deepspeed_route

# deepspeed.initialize's default port, without importing DeepSpeed (the module imports only the standard library).
from lazyzero.engine.deepspeed_args import DEEPSPEED_DEFAULT_PORT

__all__ = ["initialize", "patch_deepspeed", "unpatch_deepspeed", "LazyZeroEngine", "LazyZeroConfig",
           "LazyZeroConfigError", "TrainerLogsCallback", "__version__"]


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               distributed_port=DEEPSPEED_DEFAULT_PORT, mpu=None, dist_init_required=None, collate_fn=None,
               config=None, mesh_param=None, config_params=None):
    """`deepspeed.initialize` with the "lazyzero" section: same arguments, same return value
    (engine, optimizer, dataloader, lr_scheduler), the engine a `LazyZeroEngine`.

    The section is validated before anything is built, every problem reported at once with its key
    path (`LazyZeroConfigError`). `config` may be a path or a dict; `args.deepspeed_config` is
    honoured as DeepSpeed does. Pipeline and hybrid engines are not supported.
    """
    from lazyzero.engine.initialize import initialize as build

    return build(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                 training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                 dist_init_required=dist_init_required, collate_fn=collate_fn, config=config, mesh_param=mesh_param,
                 config_params=config_params)


def patch_deepspeed():
    """After this call `deepspeed.initialize`, wherever it is called from (the Hugging Face Trainer,
    Accelerate, Lightning, your own code), returns a `LazyZeroEngine` for a config with a "lazyzero"
    section, validated as `initialize` validates it; a config without one gets plain DeepSpeed.
    Calling it again does nothing; `unpatch_deepspeed()` undoes it."""
    deepspeed_route.patch_deepspeed()


def unpatch_deepspeed():
    """Give `deepspeed.initialize` back DeepSpeed's own function; returns whether it was patched."""
    return deepspeed_route.unpatch_deepspeed()


# `TrainerLogsCallback` imports transformers; `LazyZeroConfig` is the config package's own lazy name.
_HOMES = {"LazyZeroEngine": "engine.engine", "TrainerLogsCallback": "engine.trainer_logs",
          "LazyZeroConfig": "config", "LazyZeroConfigError": "config"}

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
