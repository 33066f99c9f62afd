"""Whole copies of parts of a model that no rank holds whole (docs/plan.md, "Planning partitioned models").

The profiler measures one decoder layer at a time, and the embedding + head once, on standalone
copies. A model may come in three forms:

- whole (every parameter a full tensor): the copy is a deep copy;
- partitioned by `deepspeed.zero.Init` (each rank holds 1/N of every parameter, `ds_numel` and
  `ds_shape` give the full size): the part's parameters are gathered for the copy
  (`deepspeed.zero.GatheredParameters`, a collective: every rank copies the same parts in the same
  order) and released again, so a rank holds one layer whole at a time, with the model's real weights;
- on the meta device (shapes without memory): the copy gets fresh weights drawn as the model's own
  initialization draws them (`_init_weights`, which also computes the rotary buffers). Costs do not
  depend on the values; the gradient errors of such a copy are those of a randomly initialized model.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn


def is_partitioned(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter (converted by zero.Init or by a ZeRO-3 engine): `param.data` is not its value."""
    return hasattr(param, "ds_id")


def full_numel(param: torch.Tensor) -> int:
    """Elements of the whole parameter, partitioned or not (a meta tensor knows its shape)."""
    return int(param.ds_numel) if is_partitioned(param) else param.numel()


def full_shape(param: torch.Tensor) -> torch.Size:
    return param.ds_shape if is_partitioned(param) else param.shape


def held_bytes(param: torch.Tensor) -> int:
    """Bytes of `param` this rank holds in memory: its partition (none while on NVMe), nothing on meta."""
    if is_partitioned(param):
        partition = param.ds_tensor
        return 0 if partition is None or partition.is_meta else partition.numel() * partition.element_size()
    return 0 if param.is_meta else param.numel() * param.element_size()


def held_on_compute_device(model: nn.Module) -> int:
    """Bytes of `model`'s parameters this rank holds in the memory training computes in
    (`host_memory.compute_memory_bytes`): on CUDA those on the device, else every one it holds."""
    def device_type(param: torch.Tensor) -> str:
        held = param.ds_tensor if is_partitioned(param) and param.ds_tensor is not None else param
        return held.device.type

    on_cuda = torch.cuda.is_available()
    return sum(held_bytes(p) for p in model.parameters() if not on_cuda or device_type(p) == "cuda")


def holds_whole_model(model: nn.Module) -> bool:
    """True when every parameter of `model` is a full tensor in memory."""
    return not any(is_partitioned(p) or p.is_meta for p in model.parameters())


def materialized(module: nn.Module, model: nn.Module, device: torch.device, seed: int = 0) -> nn.Module:
    """A standalone copy of `module` (a part of `model`, or `model` itself with parts replaced) on
    `device`, every parameter and buffer a whole tensor: see the module docstring. `module` itself
    is left as it was."""
    params = list(module.parameters())
    partitioned = [p for p in params if is_partitioned(p)]
    meta = [t for t in [*params, *module.buffers()] if t.is_meta and not is_partitioned(t)]
    with _gathered(partitioned):
        # deepcopy takes what `memo` holds for an object instead of copying it: the stand-ins below
        # replace the partitioned (or meta) tensors and everything else is copied as usual.
        memo = {id(p): nn.Parameter(p.data.to(device, copy=True), requires_grad=p.requires_grad) for p in partitioned}
        memo.update({id(t): _empty_like(t, device) for t in meta})
        copied = copy.deepcopy(module, memo)
    if meta:
        _initialize(copied, model, seed)
    return copied.to(device)


@contextlib.contextmanager
def _gathered(params: list[torch.Tensor]):
    if not params:
        yield
        return
    import deepspeed

    # modifier_rank None: read only; every rank gets the whole tensors, and the partitions stay as they were.
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


@torch.no_grad()
def _initialize(copied: nn.Module, model: nn.Module, seed: int) -> None:
    """Weights (and rotary buffers) as `model`'s own initialization draws them, from `seed`."""
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise ValueError(f"{type(model).__name__}: a model on the meta device needs `_init_weights` (a transformers "
                         "model) for its parts to be measured")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for submodule in copied.modules():
            init(submodule)
