"""Where int8 gradients enter DeepSpeed (0.19.7-0.19.8): one replacement per ZeRO stage, installed on instances.

Each replacement is bound to one engine's objects (instance attributes shadow the class methods),
so other engines in the process, and every engine with `gradients.enabled: false`, run
DeepSpeed's code unchanged. Each keeps DeepSpeed's averaging and pre/post-division arithmetic
(scale factors below, written out from `deepspeed/runtime/`) and its return dtype, and replaces
only the collective (docs/deepspeed-internals.md, "Gradient reduction paths"):

* stage 3: `__avg_scatter_grads` (reduce-scatter of a bucket of gradients) and
  `__avg_scatter_contiguous_grads` (used when `reduce_scatter` is false; DeepSpeed all-reduces the
  bucket there, we reduce-scatter it, since each rank keeps only its own chunks);
* stage 1/2: `average_tensor`, per-owner slices of the flat bucket (`ChunkLayout.from_ranges`), or
  the whole bucket all-reduced when `reduce_scatter` is false;
* stage 0 (and stage 1 under DeepSpeed's BF16_Optimizer): the engine's `allreduce_bucket`.

The optimizer step is guarded on every stage (`_install_step_guard`): an overflow seen by any
rank skips the step on every rank, through the ZeRO optimizers' own overflow path where they
have one (`_update_scale`, which also lowers a dynamic loss scale).

With several nodes (`node_layout.py`) each exchange takes two hops, inside nodes then across.

The exchanges run on the current stream: with `overlap_comm` they do not overlap the backward.

Every replacement goes through `lazyzero.patch_point`, which declares these methods and refuses a
second change of one of them on the same object.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils.logging import print_dist

from lazyzero.gradients import ChunkLayout
from lazyzero.gradients.exchange import GradientExchange
from lazyzero.gradients.node_layout import node_groups_for
from lazyzero.patch_point import replace_method, wrap_method

_STAGE3_PREFIX = "_DeepSpeedZeroOptimizer_Stage3__"
_OWNER = "lazyzero.gradients (int8 exchange)"


def install_int8_gradients(engine) -> GradientExchange:
    """Route `engine`'s gradient reduction through int8 collectives; returns the exchange."""
    optimizer = engine.optimizer
    config = engine.lazyzero_config.gradients
    nodes = node_groups_for(data_parallel_group(engine), config.ranks_per_node, engine.device)
    exchange = GradientExchange(config, engine.device, lambda: engine.global_steps,
                                loss_scale=lambda: current_loss_scale(optimizer), nodes=nodes)
    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        _install_stage3(optimizer, exchange)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):
        _install_stage1_and_2(optimizer, exchange)
    elif reduces_through_engine_allreduce(engine):
        replace_method(engine, "allreduce_bucket", _stage0_allreduce_bucket(engine, exchange), owner=_OWNER)
    else:
        raise NotImplementedError(
            f"lazyzero.gradients.enabled: true, but no int8 path for optimizer {type(optimizer).__name__} "
            f"at zero_optimization.stage {engine.zero_optimization_stage()}")
    _install_step_guard(optimizer, exchange)
    hops = (f"two hops ({nodes.nodes} nodes x {nodes.ranks_per_node} ranks: inside nodes, then across)"
            if nodes is not None else "one hop")
    print_dist(f"lazyzero: int8 gradient exchange in {hops}, block size {config.block_size}", ranks=[0])
    return exchange


def data_parallel_group(engine):
    """The group the engine's gradient buckets are reduced over: the ZeRO optimizer's, or the
    engine's at stage 0."""
    return getattr(engine.optimizer, "dp_process_group", None) or engine.seq_data_parallel_group


def current_loss_scale(optimizer) -> float:
    """The factor the gradients being reduced carry: the fp16 loss scale, 1 without one (fp32 and
    bf16 optimizers, torch optimizers)."""
    scale = getattr(optimizer, "loss_scale", None)
    return float(scale) if isinstance(scale, (int, float)) or torch.is_tensor(scale) else 1.0


# ---------------------------------------------------------------------------------- stage 3

def stage3_scatter_scale(optimizer, params, world_size: int) -> float:
    """Factor on the plain sum that `__avg_scatter_grads` applies: predivide, the 1/W of
    `reduce_scatter_coalesced`, postscale (skipped when the factor equals W), then W/averaging W."""
    predivide = optimizer.gradient_predivide_factor
    scale = 1.0 / world_size
    if optimizer.postscale_gradients and predivide != 1.0:
        scale /= predivide
        if predivide != world_size:
            scale *= predivide
    return scale * world_size / optimizer._gradient_averaging_world_size(params, world_size)


def stage3_contiguous_scale(optimizer, params, world_size: int) -> float:
    """Factor on the plain sum that `__avg_scatter_contiguous_grads` applies."""
    averaging = optimizer._gradient_averaging_world_size(params, world_size)
    predivide = optimizer.gradient_predivide_factor
    scale = optimizer.sequence_parallel_size / averaging
    if optimizer.postscale_gradients and predivide != 1.0:
        scale /= predivide
    if optimizer.postscale_gradients and predivide != averaging:
        scale *= predivide
    return scale


def _install_stage3(optimizer, exchange: GradientExchange) -> None:
    def reduce_bucket(params, flat, sizes, scale_of) -> list[torch.Tensor]:
        """This rank's chunk of each gradient laid end to end in `flat` (DeepSpeed's chunking),
        reduced, in fp32."""
        optimizer._assert_same_partition_group(params)
        group = optimizer._get_param_partition_group(params[0])
        world_size = dist.get_world_size(group)
        layout = ChunkLayout.per_tensor(sizes, world_size)
        output = exchange.reduce_scatter(flat, group, layout, scale_of(optimizer, params, world_size))
        return layout.split(dist.get_rank(group), output)

    def avg_scatter_grads(params_to_reduce, communication_data_type):
        grads = [param.grad.reshape(-1) for param in params_to_reduce]
        chunks = reduce_bucket(params_to_reduce, torch.cat(grads), [grad.numel() for grad in grads],
                               stage3_scatter_scale)
        return [chunk.to(optimizer.gradient_accumulation_dtype) for chunk in chunks]

    def avg_scatter_contiguous_grads(buffer_to_reduce, communication_data_type):
        params = optimizer.ipg_buckets[communication_data_type].params
        sizes = [param.grad.numel() for param in params]
        chunks = reduce_bucket(params, buffer_to_reduce, sizes, stage3_contiguous_scale)
        # DeepSpeed pads this path's partitions to the parameter's partition size.
        partitions = []
        for param, chunk in zip(params, chunks):
            padded = torch.zeros(param.partition_numel(), dtype=optimizer.gradient_accumulation_dtype,
                                 device=chunk.device)
            padded[: chunk.numel()].copy_(chunk)
            partitions.append(padded)
        return partitions

    replace_method(optimizer, _STAGE3_PREFIX + "avg_scatter_grads", avg_scatter_grads, owner=_OWNER)
    replace_method(optimizer, _STAGE3_PREFIX + "avg_scatter_contiguous_grads", avg_scatter_contiguous_grads,
                   owner=_OWNER)


# ------------------------------------------------------------------------------- stage 1 / 2

def full_reduction_scale(optimizer, world_size: int) -> float:
    """Factor on the plain sum that `gradient_reduction_w_predivide` applies (its three branches)."""
    if not optimizer.gradient_average:
        return 1.0
    predivide = optimizer.gradient_predivide_factor
    if optimizer.postscale_gradients:
        scale = 1.0 / predivide
        if predivide != world_size:
            scale *= predivide / (world_size / optimizer.sequence_parallel_size)
        return scale
    return optimizer.sequence_parallel_size / world_size


def owner_slices(optimizer, bucket) -> list[tuple[int, int, int, int, int]]:
    """(owner rank, offset in the flat bucket, length, group index, param id) of every gradient
    slice of `bucket`: each gradient goes to the partitions it overlaps, from its start offset in
    each (the optimizer's `grad_start_offset`)."""
    slices = []
    position = 0
    for group_index, index_in_group, param_id in bucket.params:
        numel = optimizer.bit16_groups[group_index][index_in_group].numel()
        starts = sorted((optimizer.grad_start_offset[group_index][owner][param_id], owner)
                        for owner in optimizer.param_to_partition_ids[group_index][param_id])
        ends = [start for start, _ in starts[1:]] + [numel]
        for (start, owner), end in zip(starts, ends):
            slices.append((owner, position + start, end - start, group_index, param_id))
        position += numel
    return slices


def _install_stage1_and_2(optimizer, exchange: GradientExchange) -> None:
    if not optimizer.contiguous_gradients:
        # Without a contiguous bucket DeepSpeed reduces through `buffered_reduce_fallback`, a
        # full-precision path this hook does not replace; refuse rather than send fp32 silently.
        raise ValueError("lazyzero.gradients.enabled: true at zero_optimization.stage 1/2 needs "
                         "zero_optimization.contiguous_gradients true")
    if optimizer.has_moe_layers:
        # Expert gradients reduce over expert groups, and owner slices would need them too.
        raise NotImplementedError("lazyzero.gradients.enabled: true at zero_optimization.stage 1/2 "
                                  "does not support MoE layers yet")

    def average_tensor(tensor, communication_data_type):
        bucket = optimizer.ipg_buckets[communication_data_type]
        group = optimizer.dp_process_group
        world_size = dist.get_world_size(group)
        if not optimizer.reduce_scatter:
            tensor.copy_(exchange.all_reduce(tensor, group, full_reduction_scale(optimizer, world_size)))
            if _keeps_compact_grad_partition(optimizer):
                optimizer._add_full_reduction_to_compact_grad_partition(tensor, communication_data_type)
            return
        scale = optimizer.sequence_parallel_size / world_size if optimizer.gradient_average else 1.0
        slices = owner_slices(optimizer, bucket)
        layout = ChunkLayout.from_ranges(tensor.numel(), world_size, [piece[:3] for piece in slices])
        reduced = exchange.reduce_scatter(tensor, group, layout, scale)
        rank = dist.get_rank(group)
        mine = [piece for piece in slices if piece[0] == rank]
        for (_, offset, length, group_index, param_id), values in zip(mine, layout.split(rank, reduced)):
            _store_owned_slice(optimizer, tensor[offset : offset + length], values, group_index, rank, param_id)

    replace_method(optimizer, "average_tensor", average_tensor, owner=_OWNER)


def _store_owned_slice(optimizer, bucket_slice, values, group_index: int, rank: int, param_id: int) -> None:
    """Where DeepSpeed's `reduce` to the owner leaves its result: in the bucket, or added to the
    compact fp32 partition buffer when the optimizer keeps one (low-precision model, fp32 grads)."""
    output = None
    if _keeps_compact_grad_partition(optimizer):
        output = optimizer._get_compact_grad_partition_slice(group_index, rank, param_id, values.numel())
    if output is None:
        bucket_slice.copy_(values)
    else:
        output.add_(values.to(output.dtype))


def _keeps_compact_grad_partition(optimizer) -> bool:
    """DeepSpeed 0.19.8 adds reduced owner slices to a compact fp32 partition buffer (low-precision
    model, fp32 gradients); 0.19.7 has no such buffer and leaves every reduced slice in the bucket
    (docs/deepspeed-internals.md, "Supported DeepSpeed versions")."""
    return hasattr(optimizer, "_get_compact_grad_partition_slice")


# ----------------------------------------------------------------------------------- stage 0

def reduces_through_engine_allreduce(engine) -> bool:
    """True when `DeepSpeedEngine.allreduce_gradients` reduces through `allreduce_bucket`: at
    stage 0, and at stage 1 with an optimizer that has no `reduce_gradients` of its own (the
    BF16_Optimizer DeepSpeed picks for a bf16 model with fp32 gradient accumulation)."""
    if engine.zero_optimization_partition_gradients():
        return False
    return engine.zero_optimization_stage() == 0 or not hasattr(engine.optimizer, "reduce_gradients")


def _stage0_allreduce_bucket(engine, exchange: GradientExchange) -> Callable:
    def allreduce_bucket(bucket, dp_group, dp_world_size=None):
        tensor = engine.flatten(bucket)
        world_size = dp_world_size or dist.get_world_size(group=dp_group)
        # Each of DeepSpeed's three branches (no averaging, postscale, prescale) ends at sum / W.
        scale = 1.0 / world_size if engine.gradient_average else 1.0
        tensor.copy_(exchange.all_reduce(tensor, dp_group, scale))
        return tensor

    return allreduce_bucket


# ------------------------------------------------------------------------------ step guard

def _install_step_guard(optimizer, exchange: GradientExchange) -> None:
    """Close each optimizer step with `exchange.finish_step` and skip it on overflow."""
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3)):
        # Both ZeRO steps pass their overflow verdict through `_update_scale` and then, on
        # overflow, clear the gradients and return before touching parameters.
        def guarded_update_scale(update_scale, has_overflow=False):
            if exchange.finish_step():
                optimizer.overflow = has_overflow = True
            return update_scale(has_overflow)

        wrap_method(optimizer, "_update_scale", guarded_update_scale, owner=_OWNER)
        return

    def guarded_step(step, *args, **kwargs):
        overflow = exchange.finish_step()
        # DeepSpeedEngine._take_model_step reads `optimizer.overflow` to count the skipped step
        # and hold the learning-rate schedule.
        optimizer.overflow = overflow
        if not overflow:
            return step(*args, **kwargs)
        if isinstance(optimizer, BF16_Optimizer):
            # What its own step does on an invalid norm: its fp32 accumulated gradients are not
            # cleared by the engine's zero_grad.
            optimizer.clear_hp_grads()
            optimizer.clear_lp_grads()
        return None

    wrap_method(optimizer, "step", guarded_step, owner=_OWNER)
