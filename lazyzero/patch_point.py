"""The one door through which lazyzero changes DeepSpeed's classes, objects and module globals (and,
under `lazyzero.patch_deepspeed()`, the Hugging Face Trainer's checkpoint-folder rules and default
callbacks; with lazy checkpoints, torch's `destroy_process_group`).

lazyzero subclasses where DeepSpeed offers a class to subclass (the engine, the ZeRO-3 optimizer,
checkpoint engines). Where it does not, a change goes through this module: `PATCH_POINTS` declares
every attribute that may change, with its kind and the parameters of DeepSpeed's original, and
tests/engine/test_patch_point.py checks each against the installed DeepSpeed. The door refuses
anything undeclared, a second change of one attribute on one object (two features on one method
must be composed in one place, in the open), and a replacement that would hide an override in a
subclass from outside DeepSpeed (lazyzero's own, such as TieredZeroOptimizer_Stage3, or a user's)
unless the caller says why that is correct (`over_override`). Every change is
logged with DeepSpeed's version (`applied_patches`). The map of changes and why each is needed:
docs/patch-point.md.

Kinds:
- REPLACE: a method replaced on one object; the new function runs instead of DeepSpeed's and takes
  exactly the original's parameters (without self), since DeepSpeed calls it as it calls its own.
- WRAP: a method wrapped on one object; DeepSpeed's method, as the object's class resolves it,
  still runs inside the wrapper, so no override is hidden.
- SWAP: a module or class attribute swapped for the duration of a block (while DeepSpeed builds).
- EXTEND: an item appended to a module-level list of DeepSpeed's, once.
- ROUTE: a public module function of DeepSpeed's routed to lazyzero's until undone; the new function
  takes exactly the original's parameters, since every caller (user code, Accelerate, the Hugging
  Face Trainer) calls it as DeepSpeed's, and it keeps the original reachable (`__wrapped__`). A
  method of a trainer library's class is routed the same way, on the class (Lightning's and
  Accelerate's folder rules, Accelerate's count of CPU ranks).
- REDIRECT: a public function that scripts bind by name when they are imported (transformers' example
  scripts run `from transformers.trainer_utils import get_last_checkpoint` before any line of theirs
  could call `lazyzero.patch_deepspeed()`), so routing the module attribute would miss them: the
  function object itself calls lazyzero's until undone (its code is swapped for a call of it), so
  every name bound to it does; the original runs from a copy (`original_function`).
- SET: state assigned from outside on an object a library's own code reads: a DeepSpeed optimizer's
  private fields (the loss scaler a resume restores, the norm the engine reports), a ZeRO parameter's
  swap fields, and, for transformers, a model module's `forward` and a checkpointing layer's
  `_gradient_checkpointing_func`. There is no original to call, so no parameters: the table names the
  class whose code reads or writes the attribute (for state on objects it does not own, such as a
  parameter, the class that handles them), and the check is that its source still does.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import re
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import deepspeed

REPLACE, WRAP, SWAP, EXTEND, ROUTE, REDIRECT, SET = "replace", "wrap", "swap", "extend", "route", "redirect", "set"

_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_STAGE12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
_INIT = "deepspeed.runtime.zero.partition_parameters:Init"
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"


# The DeepSpeed releases lazyzero is tested with, lowest and highest (pyproject.toml declares the same
# range; docs/deepspeed-internals.md, "Supported DeepSpeed versions", says what differs and how to test one).
TESTED_DEEPSPEED = ("0.19.7", "0.19.8")


@dataclass(frozen=True)
class PatchPoint:
    """One DeepSpeed attribute lazyzero may change. `target` is "module:Qualified.attribute";
    `parameters` names the original callable's parameters without self (None: not callable), as in the
    highest tested DeepSpeed; `other_versions` gives (version, parameters) for tested releases where
    the original takes others."""

    target: str
    kind: str
    parameters: tuple[str, ...] | None
    why: str
    other_versions: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def attribute(self) -> str:
        return self.target.partition(":")[2].rpartition(".")[2]

    def parameters_in(self, version: str) -> tuple[str, ...] | None:
        """The original's parameters in DeepSpeed `version`."""
        return dict(self.other_versions).get(version, self.parameters)


_STAGE3_PARAMETERS = (
    "module", "init_optimizer", "param_names", "timers", "ds_config", "static_loss_scale", "dynamic_loss_scale",
    "dynamic_loss_args", "verbose", "contiguous_gradients", "reduce_bucket_size", "prefetch_bucket_size",
    "max_reuse_distance", "max_live_parameters", "param_persistence_threshold", "model_persistence_threshold",
    "dp_process_group", "reduce_scatter", "overlap_comm", "offload_optimizer_config", "offload_param_config",
    "zenflow_config", "sub_group_size", "offload_ratio", "mpu", "clip_grad", "gradient_accumulation_dtype",
    "communication_data_type", "fp16_master_weights_and_gradients", "bf16_master_weights_and_gradients",
    "bf16_optimizer_states", "postscale_gradients", "gradient_predivide_factor", "gradient_accumulation_steps",
    "elastic_checkpoint", "aio_config", "all2all_process_group", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_module_granularity_threshold", "log_trace_cache_warnings",
    "enable_sanity_checks", "cpuadam_cores_perc", "save_muon_momentum_buffer_in_memory")


def _inserted_after(names: tuple[str, ...], anchor: str, name: str) -> tuple[str, ...]:
    at = names.index(anchor) + 1
    return names[:at] + (name,) + names[at:]


_STEP_GUARD = "int8 gradients: an overflow seen by any rank skips the step on every rank (gradients/zero_hooks.py)"

PATCH_POINTS: tuple[PatchPoint, ...] = (
    # int8 gradient exchange (gradients/zero_hooks.py): DeepSpeed has no hook for the collective.
    PatchPoint(f"{_STAGE3}._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", REPLACE,
               ("params_to_reduce", "communication_data_type"),
               "int8 reduce-scatter of a ZeRO-3 gradient bucket instead of the full-precision one"),
    PatchPoint(f"{_STAGE3}._DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads", REPLACE,
               ("buffer_to_reduce", "communication_data_type"),
               "int8 reduce-scatter of a contiguous ZeRO-3 bucket (reduce_scatter false) instead of an all-reduce"),
    PatchPoint(f"{_STAGE12}.average_tensor", REPLACE, ("tensor", "communication_data_type"),
               "int8 reduction of a ZeRO-1/2 gradient bucket to its owners"),
    PatchPoint("deepspeed.runtime.engine:DeepSpeedEngine.allreduce_bucket", REPLACE,
               ("bucket", "dp_group", "dp_world_size"),
               "int8 all-reduce of a stage-0 (or BF16_Optimizer) gradient bucket"),
    PatchPoint(f"{_STAGE3}._update_scale", WRAP, ("has_overflow",), _STEP_GUARD),
    PatchPoint(f"{_STAGE12}._update_scale", WRAP, ("has_overflow",), _STEP_GUARD),
    PatchPoint("deepspeed.runtime.bf16_optimizer:BF16_Optimizer.step", WRAP, ("closure",), _STEP_GUARD),
    PatchPoint("deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer.step", WRAP, ("closure",), _STEP_GUARD),
    PatchPoint("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer.step", WRAP, ("closure",),
               _STEP_GUARD),
    # The basic optimizer DeepSpeed steps itself at stage 0 (torch's, DeepSpeed's FusedAdam, the 8-bit one).
    PatchPoint("torch.optim.optimizer:Optimizer.step", WRAP, ("closure",), _STEP_GUARD),
    # Fused clipping with the 8-bit optimizer (optimizer/clipping.py).
    PatchPoint(f"{_STAGE12}.scaled_global_norm", REPLACE, ("norm_type",),
               "fused global norm of the ZeRO-1/2 gradient partitions, one reduction across ranks"),
    PatchPoint(f"{_STAGE12}.unscale_and_clip_grads", REPLACE, ("grad_groups_flat", "total_norm"),
               "the clip factor goes to the 8-bit step as grad_scale instead of a pass over the gradients"),
    PatchPoint(f"{_STAGE3}._get_norm_groups", REPLACE, (),
               "fused global norm of the ZeRO-3 gradient partitions, one reduction across ranks"),
    PatchPoint(f"{_STAGE3}.unscale_and_clip_grads", REPLACE, ("sub_group_id", "total_norm"),
               "the clip factor goes to the 8-bit step as grad_scale instead of a pass over the gradients"),
    # Classes DeepSpeed picks from a module global or a class attribute while it builds ZeRO-3.
    PatchPoint("deepspeed.runtime.zero.stage3:PartitionedOptimizerSwapper", SWAP,
               ("swap_config", "aio_config", "base_folder", "optimizer", "largest_numel", "device", "dtype",
                "timers"),
               "8-bit optimizer states swap to NVMe packed (optimizer/nvme_swap.py)"),
    PatchPoint("deepspeed.runtime.zero.stage3:PipelinedOptimizerSwapper", SWAP,
               ("swap_config", "aio_config", "base_folder", "optimizer", "largest_numel", "device", "dtype",
                "timers"),
               "8-bit optimizer states swap to NVMe packed, pipelined (optimizer/nvme_swap_pipelined.py)"),
    PatchPoint(_STAGE3, SWAP, _STAGE3_PARAMETERS,
               "the engine builds TieredZeroOptimizer_Stage3 for a per-layer placement "
               "(plan/deepspeed/zero_placement.py)",
               # 0.19.7 also takes ZeRO++ LoCo's setting; the tiered builder hands every argument on as given.
               other_versions=(("0.19.7", _inserted_after(_STAGE3_PARAMETERS, "zero_module_granularity_threshold",
                                                          "zeropp_loco_param")),)),
    PatchPoint("deepspeed.runtime.zero.partition_parameters:Init._partition_param", SWAP,
               ("param", "buffer", "has_been_updated", "free_data"),
               "only the placed parameters' partitions go to NVMe at conversion (plan/deepspeed/zero_placement.py)"),
    # Checkpoint files read without running code, from the bytes whose hash was checked, when lazy
    # checkpoints are off and DeepSpeed's own engine loads (checkpoint/verified_read.py).
    *(PatchPoint(f"deepspeed.runtime.checkpoint_engine.{module}:{cls}.load", REPLACE, ("path", "map_location"),
                 "checkpoint files loaded with weights_only and checked against the manifest (checkpoint/feature.py)")
      for module, cls in (("torch_checkpoint_engine", "TorchCheckpointEngine"),
                          ("decoupled_checkpoint_engine", "DecoupledCheckpointEngine"),
                          ("fast_checkpoint_engine", "FastCheckpointEngine"))),
    PatchPoint("deepspeed.runtime.zero.utils:ZERO_SUPPORTED_OPTIMIZERS", EXTEND, None,
               "ZeRO accepts the 8-bit optimizers without zero_allow_untested_optimizer (optimizer/engine_setup.py)"),
    # `lazyzero.patch_deepspeed()` (engine/deepspeed_route.py): trainers that call deepspeed.initialize
    # themselves (Accelerate, the Hugging Face Trainer) build a LazyZeroEngine from a "lazyzero" section.
    PatchPoint("deepspeed:initialize", ROUTE,
               ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port",
                "mpu", "dist_init_required", "collate_fn", "config", "mesh_param", "config_params"),
               "a config with a \"lazyzero\" section builds a LazyZeroEngine; any other goes to DeepSpeed's own"),
    # With it, the trainers' rules for picking and rotating checkpoint folders, where each trainer is
    # installed (checkpoint/trainer_folders.py): an uncommitted lazy checkpoint is never resumed from, and
    # the Trainer never rotates for one; and Accelerate's count of CPU ranks (engine/accelerate_ranks.py).
    PatchPoint("transformers.trainer_utils:get_last_checkpoint", REDIRECT, ("folder",),
               "the Trainer and the scripts that ask transformers for the last checkpoint get the newest "
               "folder whose lazy checkpoint is committed"),
    PatchPoint("lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._find_last_checkpoints", ROUTE,
               ("trainer",), "ckpt_path=\"last\" never names a folder whose lazy checkpoint is uncommitted"),
    PatchPoint("accelerate.accelerator:Accelerator.load_state", ROUTE,
               ("input_dir", "load_kwargs", "load_model_func_kwargs"),
               "load_state() with automatic checkpoint naming loads the newest committed folder"),
    PatchPoint("accelerate.state:PartialState._prepare_backend", ROUTE, ("cpu", "sagemaker_dp", "backend"),
               "Accelerate counts every CPU rank of a DeepSpeed launch, so each trains on its own shard"),
    PatchPoint("transformers.trainer:rotate_checkpoints", ROUTE,
               ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime", "checkpoint_prefix"),
               "rotation never deletes the newest committed folder while a newer one is uncommitted"),
    # The end of a job (checkpoint/job_end.py, checkpoint/trainer_end.py): queued lazy checkpoints commit first.
    PatchPoint("transformers.trainer:DEFAULT_CALLBACKS", EXTEND, None,
               "every Trainer built after patch_deepspeed() waits for lazy commits when train() ends, and stops "
               "(saving, with checkpoint.save_on_sigterm) at the step every rank agrees on after a SIGTERM"),
    PatchPoint("torch.distributed:destroy_process_group", ROUTE, ("group",),
               "lazy checkpoints commit and their threads stop before the world group, on which their agreement "
               "runs, is destroyed (Accelerate's end_training, a script's last line)"),
    # Private state set from outside (SET). A resume that DeepSpeed's loader cannot do restores the
    # saved loss scaler as its `_rigid_load_state_dict` does (optimizer/zero3_reshard.py, `restore_loss_scaler`).
    *(PatchPoint(f"{_STAGE3}.{name}", SET, None,
                 "an NVMe-offloaded or re-split ZeRO-3 resume restores the saved loss scaler "
                 "(checkpoint/nvme_restore.py, optimizer/zero3_reshard.py)")
      for name in ("loss_scaler", "dynamic_loss_scale", "overflow")),
    PatchPoint(f"{_ENGINE}._global_grad_norm", SET, None,
               "stage 0: the norm computed for fused clipping, which the engine reads from its optimizer after "
               "the step and reports (optimizer/engine_setup.py)"),
    PatchPoint(f"{_INIT}.remote_device", SET, None,
               "only the placed parameters are partitioned to NVMe at conversion (plan/deepspeed/zero_placement.py)"),
    PatchPoint(f"{_INIT}.nvme_swapper", SET, None,
               "parameters partitioned before the placement get the NVMe swapper zero.Init gives its own "
               "(plan/deepspeed/zero_placement.py)"),
    PatchPoint(f"{_INIT}.final_location", SET, None,
               "a partition moved to NVMe after conversion is marked as zero.Init marks its own "
               "(plan/deepspeed/zero_placement.py)"),
    # transformers models: a module's forward rewritten on the instance (nn.Module.__call__ reads
    # `self.forward`), and a decoder layer's recompute through torch's non-reentrant checkpoint.
    PatchPoint("torch.nn.modules.module:Module.forward", SET, None,
               "saved-activation rewrites of norms and gated MLPs, and the fused loss head of a causal LM "
               "(activations/rewrites.py, activations/loss_head.py)"),
    PatchPoint("transformers.modeling_layers:GradientCheckpointingLayer._gradient_checkpointing_func", SET, None,
               "activations.recompute_layers recomputes chosen decoder layers (activations/engine_setup.py)"),
)

_BY_TARGET = {point.target: point for point in PATCH_POINTS}


@dataclass(frozen=True)
class AppliedPatch:
    """One change made through the door: the declared `target`, the `attribute` changed, on what
    (`holder`: the object's class or the module), by whom, under which DeepSpeed."""

    target: str
    attribute: str
    holder: str
    owner: str
    deepspeed_version: str
    over_override: str | None = None


_applied: list[AppliedPatch] = []
# object -> attribute -> owner, for the refusal of a second change on the same object.
_changed_on_objects: weakref.WeakKeyDictionary[object, dict[str, str]] = weakref.WeakKeyDictionary()
# (id of the module or class, attribute) -> owner, while a swap is active.
_active_swaps: dict[tuple[int, str], str] = {}


class PatchRefused(RuntimeError):
    """A change the door does not allow; the message says which and what to do instead."""


def applied_patches() -> tuple[AppliedPatch, ...]:
    """Every change made through the door in this process, oldest first."""
    return tuple(_applied)


def replace_method(obj, name: str, new: Callable, *, owner: str, over_override: str | None = None) -> None:
    """Make `obj.name` be `new` (a plain function: DeepSpeed calls it with the original's parameters,
    without self) on this object only. `over_override`: why hiding the override of `name` in a
    subclass from outside DeepSpeed is correct; required when such an override exists."""
    point = _point_on_object(obj, name, REPLACE)
    _check_parameters(point, new)
    hidden = _overrides_below(type(obj), _declaring_class(type(obj), point), name)
    if hidden and not over_override:
        raise PatchRefused(
            f"{owner} replaces {name} on a {type(obj).__name__}, whose {', '.join(hidden)} overrides DeepSpeed's "
            f"{point.target}: the replacement would hide that override. Compose them explicitly, or pass "
            "over_override='<why replacing it is correct>'")
    _claim_on_object(obj, name, owner)
    setattr(obj, name, new)
    _record(point, obj, owner, over_override if hidden else None)


def wrap_method(obj, name: str, wrapper: Callable, *, owner: str) -> None:
    """Make `obj.name(*args, **kwargs)` call `wrapper(original, *args, **kwargs)` on this object only,
    `original` being the method as the object resolved it before (overrides included)."""
    point = _point_on_object(obj, name, WRAP)
    _claim_on_object(obj, name, owner)
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        return wrapper(original, *args, **kwargs)

    setattr(obj, name, wrapped)
    _record(point, obj, owner)


@contextmanager
def swapped(holder, name: str, new, *, owner: str) -> Iterator[None]:
    """`holder.name` (a module global or a class attribute) is `new` inside the block, and what it
    was again after it, also on an exception. A swap of the same attribute inside is refused."""
    point = _declared(_target_of(holder, name), SWAP, f"{owner} swaps {name}")
    key = (id(holder), name)
    if key in _active_swaps:
        raise PatchRefused(f"{owner} swaps {point.target}, already swapped by {_active_swaps[key]} in an enclosing "
                           "block: one swap must build what both need")
    original = getattr(holder, name)
    _active_swaps[key] = owner
    setattr(holder, name, new)
    _record(point, holder, owner)
    try:
        yield
    finally:
        setattr(holder, name, original)
        del _active_swaps[key]


def extend_list(module, name: str, item, *, owner: str) -> None:
    """Append `item` to the list `module.name` unless it is there already."""
    point = _declared(_target_of(module, name), EXTEND, f"{owner} extends {name}")
    items = getattr(module, name)
    if item not in items:
        items.append(item)
        _record(point, module, owner)


def retract_from_list(module, name: str, item, *, owner: str) -> bool:
    """Take `item`, appended by `extend_list`, out of the list `module.name`; whether it was there."""
    _declared(_target_of(module, name), EXTEND, f"{owner} retracts from {name}")
    items = getattr(module, name)
    if item not in items:
        return False
    items.remove(item)
    return True


def route_function(module, name: str, new: Callable, *, owner: str) -> None:
    """Make `module.name` (a public function of DeepSpeed's) call `new`, which takes the original's
    parameters, until `unroute_function`. Routing again to the same `new` does nothing; routing to
    another function, or by another owner, is refused."""
    point = _declared(_target_of(module, name), ROUTE, f"{owner} routes {name}")
    current = getattr(module, name)
    route = getattr(current, "__lazyzero_route__", None)
    if route is not None:
        if route == (owner, new):
            return
        raise PatchRefused(f"{owner} routes {point.target}, already routed by {route[0]}: undo that first")
    expected = point.parameters_in(deepspeed.__version__)
    if original_parameters(current) != expected:
        raise PatchRefused(f"{point.target} takes {original_parameters(current)} in DeepSpeed {deepspeed.__version__}; "
                           f"lazyzero expects {expected}: install a DeepSpeed version lazyzero supports")
    _check_parameters(point, new, method=inspect.isclass(module))

    # functools.wraps keeps DeepSpeed's name, docstring and signature on what callers see, and the
    # original reachable through __wrapped__ (the internals check reads its parameters there).
    @functools.wraps(current)
    def routed(*args, **kwargs):
        return new(*args, **kwargs)

    routed.__lazyzero_route__ = (owner, new)
    setattr(module, name, routed)
    _record(point, module, owner)


def unroute_function(module, name: str, *, owner: str) -> bool:
    """Give `module.name` back its original if `owner` routed it; whether anything was undone."""
    current = getattr(module, name)
    route = getattr(current, "__lazyzero_route__", None)
    if route is None:
        return False
    if route[0] != owner:
        raise PatchRefused(f"{owner} undoes the routing of {name}, which {route[0]} made")
    setattr(module, name, current.__wrapped__)
    return True


def routed_to(module, name: str) -> Callable | None:
    """The function `module.name` is routed to, or None."""
    route = getattr(getattr(module, name), "__lazyzero_route__", None)
    return route[1] if route is not None else None


# (target) -> (owner, lazyzero's function, the original's code), while a function is redirected.
_redirects: dict[str, tuple[str, Callable, types.CodeType]] = {}


def redirect_function(module, name: str, new: Callable, *, owner: str) -> None:
    """Make the function `module.name` itself call `new`, which takes its parameters, until
    `unredirect_function`: every name bound to that function object, before or after, calls `new`.
    Redirecting again to the same `new` does nothing; to another, or by another owner, is refused."""
    point = _declared(_target_of(module, name), REDIRECT, f"{owner} redirects {name}")
    function = getattr(module, name)
    if point.target in _redirects:
        if _redirects[point.target][:2] == (owner, new):
            return
        raise PatchRefused(f"{owner} redirects {point.target}, already redirected by {_redirects[point.target][0]}")
    expected = point.parameters_in(deepspeed.__version__)
    parameters = inspect.signature(function).parameters.values()
    if original_parameters(function) != expected or any(p.kind != p.POSITIONAL_OR_KEYWORD for p in parameters):
        raise PatchRefused(f"{point.target} takes {tuple(map(str, parameters))}; lazyzero expects {expected}")
    _check_parameters(point, new)
    _redirects[point.target] = (owner, new, function.__code__)
    function.__code__ = _call_of(point.target, function.__name__, expected)
    _record(point, module, owner)


def unredirect_function(module, name: str, *, owner: str) -> bool:
    """Give the function `module.name` back its own code if `owner` redirected it; whether anything was undone."""
    target = _target_of(module, name)
    if target not in _redirects:
        return False
    if _redirects[target][0] != owner:
        raise PatchRefused(f"{owner} undoes the redirect of {name}, which {_redirects[target][0]} made")
    getattr(module, name).__code__ = _redirects.pop(target)[2]
    return True


def original_function(module, name: str) -> Callable:
    """The function `module.name` as its library wrote it: itself, or a copy with its own code while redirected."""
    function = getattr(module, name)
    redirect = _redirects.get(_target_of(module, name))
    if redirect is None:
        return function
    original = types.FunctionType(redirect[2], function.__globals__, function.__name__, function.__defaults__,
                                  function.__closure__)
    original.__kwdefaults__ = function.__kwdefaults__
    return original


def redirected_call(target: str) -> Callable:
    """The function a redirected `target` calls (what its swapped code looks up at each call)."""
    return _redirects[target][1]


def _call_of(target: str, name: str, parameters: tuple[str, ...]) -> types.CodeType:
    """Code of a function `name(parameters)` that calls `redirected_call(target)` with its arguments. It
    runs with the library's module globals, so it reaches lazyzero through the import system only."""
    if not all(parameter.isidentifier() for parameter in parameters):
        raise PatchRefused(f"{target}: cannot redirect a function with parameters {parameters}")
    listed = ", ".join(parameters)
    source = (f"def {name}({listed}):\n"
              f"    return __import__('lazyzero.patch_point', fromlist=['_']).redirected_call({target!r})({listed})\n")
    namespace: dict = {}
    exec(compile(source, f"<lazyzero redirect of {target}>", "exec"), namespace)  # identifiers and a repr only
    return namespace[name].__code__


# ------------------------------------------------------------------------------- the checks

def set_state(obj, name: str, value, *, owner: str, holder: str | None = None) -> None:
    """`obj.name = value`, for state declared as SET on `holder` ("module:Class", the class whose code
    reads or writes it; None: the most derived class of `obj` that declares it). State is set again
    and again (each step, each rewrite), so it is recorded once per target and owner."""
    if holder is None:
        point = _point_on_object(obj, name, SET)
    else:
        point = _declared(f"{holder}.{name}", SET, f"{owner} sets {name}")
    setattr(obj, name, value)
    if not any(patch.target == point.target and patch.owner == owner for patch in _applied):
        _record(point, obj, owner)


def clear_state(obj, name: str, *, owner: str, holder: str | None = None) -> None:
    """Undo `set_state` on `obj`: its class's attribute applies again (a rewritten forward)."""
    if holder is None:
        _point_on_object(obj, name, SET)
    else:
        _declared(f"{holder}.{name}", SET, f"{owner} clears {name}")
    vars(obj).pop(name, None)


def resolve_target(target: str):
    """The object a declared target ("module:Class.attribute") names in the installed packages."""
    module, _, qualified = target.partition(":")
    value = importlib.import_module(module)
    for part in qualified.split("."):
        value = getattr(value, part)
    return value


def original_parameters(value) -> tuple[str, ...]:
    """Parameter names of a DeepSpeed callable without self (see `original_callable`)."""
    names = tuple(inspect.signature(original_callable(value)).parameters)
    return names[1:] if names[:1] == ("self",) else names


def original_callable(value):
    """A DeepSpeed callable as DeepSpeed wrote it, looking through functools.wraps wrappers and
    `instrument_w_nvtx`, which wraps without functools.wraps (its closure holds the original)."""
    while True:
        value = inspect.unwrap(value)  # functools.wraps wrappers (a profiler's, a test's spy)
        if getattr(value, "__code__", None) is None or value.__code__.co_freevars != ("func",):
            return value
        value = value.__closure__[0].cell_contents


def deepspeed_internals_problems() -> list[str]:
    """One line per declared patch point the installed DeepSpeed lacks or declares with other
    parameters (empty when every internal lazyzero touches is as expected)."""
    problems = []
    for point in PATCH_POINTS:
        if not _library_installed(point.target):
            continue  # a trainer's rule, routed only where that library is installed
        try:
            value = resolve_target(point.target.rpartition(".")[0] if point.kind == SET else point.target)
        except (ImportError, AttributeError) as error:
            problems.append(f"{point.target}: missing in DeepSpeed {deepspeed.__version__} ({error})")
            continue
        if point.kind == SET:
            if not state_is_used(point):
                problems.append(f"{point.target}: {point.attribute} no longer appears in that class")
        elif point.kind == EXTEND:
            if not isinstance(value, list):
                problems.append(f"{point.target}: not a list in DeepSpeed {deepspeed.__version__}")
        elif not callable(value):
            problems.append(f"{point.target}: not callable in DeepSpeed {deepspeed.__version__}")
        elif original_parameters(value) != point.parameters_in(deepspeed.__version__):
            problems.append(f"{point.target}: takes {original_parameters(value)} in DeepSpeed "
                            f"{deepspeed.__version__}; lazyzero expects {point.parameters_in(deepspeed.__version__)}")
    return problems


def state_is_used(point: PatchPoint) -> bool:
    """Whether the source of the class a SET point names still reads or writes its attribute."""
    source = inspect.getsource(resolve_target(point.target.rpartition(".")[0]))
    return re.search(rf"\.{re.escape(point.attribute)}\b", source) is not None


def _library_installed(target: str) -> bool:
    return importlib.util.find_spec(target.partition(":")[0].partition(".")[0]) is not None


def _target_of(holder, name: str) -> str:
    if inspect.ismodule(holder):
        return f"{holder.__name__}:{name}"
    return f"{holder.__module__}:{holder.__qualname__}.{name}"


def _declared(target: str, kind: str, doing: str) -> PatchPoint:
    point = _BY_TARGET.get(target)
    if point is None:
        raise PatchRefused(f"{doing}: {target} is not declared in lazyzero/patch_point.py PATCH_POINTS")
    if point.kind != kind:
        raise PatchRefused(f"{doing}: {target} is declared as {point.kind}, not {kind}")
    return point


def _point_on_object(obj, name: str, kind: str) -> PatchPoint:
    """The entry for `name` on the most derived class of `obj` that declares one."""
    for cls in type(obj).__mro__:
        point = _BY_TARGET.get(_target_of(cls, name))
        if point is not None:
            return _declared(point.target, kind, f"changing {name} on a {type(obj).__name__}")
    raise PatchRefused(f"{name} on a {type(obj).__name__}: no class of its MRO declares it in "
                       "lazyzero/patch_point.py PATCH_POINTS")


def _check_parameters(point: PatchPoint, new: Callable, method: bool = False) -> None:
    names, expected = tuple(inspect.signature(new).parameters), point.parameters_in(deepspeed.__version__)
    if method:  # a method routed on its class takes self first
        names = names[1:]
    if names != expected:
        raise PatchRefused(f"the replacement of {point.target} takes {names}; DeepSpeed's takes {expected}")


def _declaring_class(cls: type, point: PatchPoint) -> type:
    return next(c for c in cls.__mro__ if _target_of(c, point.attribute) == point.target)


def _overrides_below(cls: type, declaring: type, name: str) -> list[str]:
    """Classes not from DeepSpeed between `cls` and `declaring` that define `name` themselves."""
    below = cls.__mro__[:cls.__mro__.index(declaring)]
    return [f"{c.__module__}.{c.__qualname__}" for c in below
            if name in vars(c) and not c.__module__.startswith("deepspeed.")]


def _claim_on_object(obj, name: str, owner: str) -> None:
    claimed = _changed_on_objects.setdefault(obj, {})
    if name in claimed:
        raise PatchRefused(f"{owner} changes {name} on a {type(obj).__name__} that {claimed[name]} changed already: "
                           "write the composition of both out in one place")
    claimed[name] = owner


def _record(point: PatchPoint, holder, owner: str, over_override: str | None = None) -> None:
    where = holder.__name__ if inspect.ismodule(holder) or inspect.isclass(holder) else type(holder).__name__
    _applied.append(AppliedPatch(point.target, point.attribute, where, owner, deepspeed.__version__, over_override))
