"""`lazyzero.initialize`: `deepspeed.initialize` with the `"lazyzero"` section validated first.

DeepSpeed's initialize builds its engine class directly, so we take the same ~20-line path
(docs/deepspeed-internals.md: engine subclass) and construct `LazyZeroEngine` instead. Validation runs
before torch.distributed or anything on disk is touched (docs/reliability.md, guarantee 6).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Union

import torch

from lazyzero.config import load_ds_config_file, validate_ds_config
from lazyzero.config.errors import LazyZeroConfigError
from lazyzero.config.nvme_space import nvme_swap_problems, ranks_on_this_node
from lazyzero.distributed.job_failure import apply_to_every_group, collective_timeout, end_job_on_uncaught_error
from lazyzero.distributed.mpi_extra import check_mpi_discovery_possible
from lazyzero.distributed.refusal_line import register_refusals
from lazyzero.distributed.shm_segments import release_own_segment_name
from lazyzero.engine.accelerate_ranks import LaunchRefused, check_accelerate_counts_every_rank
from lazyzero.engine.deepspeed_args import DEEPSPEED_DEFAULT_PORT, config_in_args
from lazyzero.feature import Feature
from lazyzero.ops.stale_locks import clear_stale_build_locks
from lazyzero.safe_load import UnsafeCheckpointFile


def initialize(
    args: Any = None,
    model: torch.nn.Module = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Optional[torch.utils.data.Dataset] = None,
    lr_scheduler: Any = None,
    distributed_port: int = DEEPSPEED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Optional[Callable] = None,
    config: Optional[Union[str, dict]] = None,
    mesh_param: Any = None,
    config_params: Optional[Union[str, dict]] = None,
):
    """Same arguments and return value as `deepspeed.initialize`: (engine, optimizer, dataloader, lr_scheduler).

    The engine is a `LazyZeroEngine`. `config` may be a path, base64 JSON or a dict;
    `args.deepspeed_config` (and its old name `deepscale_config`) is honoured as DeepSpeed does.
    Pipeline and hybrid engines are refused, and AutoTP with a capability on: what DeepSpeed's
    initialize does and this one does not is listed in docs/deepspeed-internals.md,
    "`deepspeed.initialize` and `lazyzero.initialize`".
    """
    ds_config = _resolve_config(args, config if config is not None else config_params)
    lazyzero_config = validate_ds_config(ds_config)
    if model is None:
        raise ValueError("lazyzero.initialize requires a model")
    clear_stale_build_locks()

    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime import zero
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import log_dist

    from lazyzero.engine.engine import LazyZeroEngine
    from lazyzero.engine.features import FeatureSet

    _check_deepspeed_internals(lazyzero_config)
    if isinstance(model, PipelineModule):
        raise ValueError("lazyzero does not support PipelineModule models; "
                         "use deepspeed.initialize for pipeline parallelism")
    zero.partition_parameters.shutdown_init_context()
    check_mpi_discovery_possible()
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=_rendezvous_port(distributed_port, TORCH_DISTRIBUTED_DEFAULT_PORT),
                          dist_init_required=dist_init_required, timeout=collective_timeout(lazyzero_config))
    release_own_segment_name(dist)
    _end_job_on_uncaught_errors(lazyzero_config)
    check_accelerate_counts_every_rank()
    log_dist(f"DeepSpeed info: version={deepspeed.__version__}, git-hash={deepspeed.__git_hash__}, "
             f"git-branch={deepspeed.__git_branch__}", ranks=[0])
    mesh_device = _mesh_device(dist, ds_config, mesh_param)
    # Before the check below, so that AutoTP asked for by deepspeed.tp_model_init is checked as AutoTP in the file.
    _merge_tensor_parallel(ds_config, mpu, mesh_param, dist)
    # Settings that depend on the number of ranks (e.g. gradients.ranks_per_node) can only be
    # checked now; still before any engine state or file exists.
    validate_ds_config(ds_config, world_size=dist.get_world_size())
    # Features that decide settings before DeepSpeed reads them (the planner) rewrite the config;
    # the engine's features are then built from the config DeepSpeed will read.
    inputs = {}
    for prepared in FeatureSet(lazyzero_config).call(Feature.prepare_run, model, ds_config, lazyzero_config, dist):
        if prepared is not None:
            ds_config, lazyzero_config = prepared.pop("ds_config"), prepared.pop("lazyzero_config")
            inputs.update(prepared)
    features = FeatureSet(lazyzero_config, **inputs)
    _check_nvme_room(ds_config, model, dist.get_world_size())
    config_class = DeepSpeedConfig(ds_config, mpu, mesh_device=mesh_device)
    features.call(Feature.check_parsed_config, config_class, model)
    deepspeed.set_optimizer_flags(config_class, model)
    engine = LazyZeroEngine(args=args, model=model, optimizer=optimizer,
                            model_parameters=model_parameters, training_data=training_data,
                            lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required,
                            collate_fn=collate_fn, config=ds_config, mesh_device=mesh_device,
                            config_class=config_class, lazyzero_config=lazyzero_config, features=features)
    zero.partition_parameters.restore_init_context()
    # DeepSpeed's own groups (ZeRO's) were created with torch's 30-minute default (distributed/job_failure.py).
    apply_to_every_group(collective_timeout(lazyzero_config))
    # DeepSpeed's initialize sets up its garbage-collection option from 0.19.8 on; 0.19.7's engine has no such step.
    if hasattr(engine, "_configure_python_gc"):
        engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _resolve_config(args: Any, config: Optional[Union[str, dict]]) -> dict:
    """The config dict, from `config` or `args.deepspeed_config`, exactly one of them (as DeepSpeed).
    DeepSpeed moves the deprecated `args.deepscale_config` into `args.deepspeed_config`; so do we."""
    from_args = config_in_args(args)
    if getattr(args, "deepscale_config", None) is not None:
        args.deepspeed_config, args.deepscale_config = from_args, None
    if from_args is not None and config is not None:
        raise ValueError("a DeepSpeed config was given both as args.deepspeed_config and as config=; give one")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("no DeepSpeed config: pass config=PATH_OR_DICT or args.deepspeed_config")
    if isinstance(config, dict):
        return dict(config)
    return _base64_config(config) or load_ds_config_file(config)


def _base64_config(config) -> Optional[dict]:
    """The dict of a config given as base64 JSON, as DeepSpeed decodes it (its launcher passes configs
    so); None for anything else, which is then read as a file with lazyzero's strict JSON reader."""
    if not isinstance(config, str) or os.path.exists(config):
        return None
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    try:
        decoded = load_ds_config(config)
    except ValueError:
        return None
    return decoded if isinstance(decoded, dict) else None


def _end_job_on_uncaught_errors(lazyzero_config) -> None:
    """An uncaught error ends the job (distributed/job_failure.py); lazyzero's refusals with one line
    each (distributed/refusal_line.py): the checkpoint a rank refuses to load or cannot save (damaged,
    unsafe to unpickle, leading outside its folder, larger than its disk), a config or NVMe folder
    refused once the ranks are known, an Accelerate launch that would train every rank alike."""
    from lazyzero.engine.features import call_on_classes

    capabilities = [error for refusals in call_on_classes(Feature.refusals) for error in refusals]
    register_refusals(*capabilities, UnsafeCheckpointFile, LazyZeroConfigError, LaunchRefused)
    end_job_on_uncaught_error(collective_timeout(lazyzero_config))


def _check_nvme_room(ds_config: dict, model, world_size: int) -> None:
    """Refuse, before DeepSpeed creates a swap file, NVMe folders without room for them (config/nvme_space.py)."""
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    problems = nvme_swap_problems(ds_config, parameters, world_size, ranks_on_this_node(world_size))
    if problems:
        raise LazyZeroConfigError(problems)


def _rendezvous_port(requested: Optional[int], default: int) -> int:
    """The port given (other than DeepSpeed's default), else MASTER_PORT from the environment, else
    DeepSpeed's default.

    Under `mpirun`, DeepSpeed's MPI discovery overwrites MASTER_PORT with the port argument; honouring
    the variable lets several jobs (or tests) share one host, as with the deepspeed launcher. The
    parameter's default is DeepSpeed's, so that the two signatures stay equal; it counts as not given."""
    if requested is not None and requested != default:
        return requested
    return int(os.environ.get("MASTER_PORT", default))


def _merge_tensor_parallel(ds_config: dict, mpu: Any, mesh_param: Any, dist) -> None:
    """deepspeed.initialize's tensor-parallel steps: the settings of `deepspeed.tp_model_init` merged
    into the config, and AutoTP's layers switched to training when the config asks for AutoTP."""
    import deepspeed
    from deepspeed.module_inject import set_autotp_mode

    deepspeed.merge_tp_model_init_into_config(ds_config, mpu, mesh_param, dist)
    autotp_size = ds_config.get("tensor_parallel", {}).get("autotp_size", 0)
    if autotp_size and autotp_size > 0:
        set_autotp_mode(training=True)


def _mesh_device(dist, ds_config: dict, mesh_param: Any):
    """The data/sequence-parallel mesh, as deepspeed.initialize builds it."""
    if mesh_param:
        return dist.initialize_mesh_device(mesh_param, ("data_parallel", "sequence_parallel"))
    if "sequence_parallel_size" in ds_config and "data_parallel_size" in ds_config:
        shape = (ds_config["data_parallel_size"], ds_config["sequence_parallel_size"])
        return dist.initialize_mesh_device(shape, ("data_parallel", "sequence_parallel"))
    return None


def _check_deepspeed_internals(lazyzero_config) -> None:
    """With any capability on, every DeepSpeed internal lazyzero may change must be as declared
    (lazyzero/patch_point.py): a DeepSpeed that moved one fails here, naming it and the version,
    instead of deep inside a training step. With every capability off nothing is changed."""
    if not lazyzero_config.enabled_features():
        return
    from lazyzero.patch_point import TESTED_DEEPSPEED, deepspeed_internals_problems

    problems = deepspeed_internals_problems()
    if problems:
        raise RuntimeError("lazyzero cannot run on this DeepSpeed: " + "; ".join(problems)
                           + ". Install a DeepSpeed version lazyzero is tested with ({} to {}), or switch the "
                           "lazyzero capabilities off".format(*TESTED_DEEPSPEED))
