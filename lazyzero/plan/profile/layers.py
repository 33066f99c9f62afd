"""Per-layer measurements of the planner's profile: time, saved activations and memory of one decoder
layer and of the embedding + head, for one micro-batch of the run's shape (docs/plan.md).

A decoder layer is measured alone, on a whole copy of it (`materialize.py`: the model may be
whole, partitioned by zero.Init or on the meta device), fed what the model really passes it. The
model's forward is replayed one layer at a time, without autograd: a copy of the model whose decoder
layers are pass-throughs runs the embedding, mask and rotary set-up and records what each layer is
called with (rotary cos/sin, mask, cache flags); then each layer's copy, in turn, computes the hidden
states the next one receives. No rank holds more than one decoder layer whole. The copy sits in an
empty shell under its model name (`model.layers.0`), so that the activation policy classifies and
names its modules as in the model. The batch is right-padded like lazyzero's training data, so the
model builds the explicit attention mask it builds in training.

The embedding + head is measured on the copy with pass-through decoder layers: embedding, mask and
rotary set-up, final norm, lm_head and loss, as one training step runs them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import Cache

from lazyzero.activations import ActivationAccounting, ActivationPacker, ActivationPolicy
from lazyzero.activations.config import ActivationsConfig
from lazyzero.activations.policy import is_decoder_layer, layer_index
from lazyzero.plan.deepspeed.implied import ModelSizes
from lazyzero.plan.profile.data import TensorInfo
from lazyzero.plan.profile.materialize import full_numel, materialized
from lazyzero.plan.profile.measure import heap_sampling_available, phase_memory, synchronize
from lazyzero.plan.solver.problem import BIT_WIDTHS

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Repeats:
    """Timed runs (median taken) after untimed warm-up runs."""

    repeats: int
    warmup: int


def decoder_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's decoder layers by module name, in layer order."""
    found = [(layer_index(name), name, module) for name, module in model.named_modules()
             if is_decoder_layer(name, module) and layer_index(name) is not None]
    return {name: module for _, name, module in sorted(found, key=lambda item: item[0])}


def model_sizes_of(model: nn.Module, world_size: int) -> ModelSizes:
    """The element counts the ZeRO-3 settings are sized from, read off the model itself (whole sizes
    of partitioned parameters)."""
    layers = list(decoder_layers(model).values())
    return ModelSizes(largest_layer_numel=max(sum(full_numel(p) for p in layer.parameters()) for layer in layers),
                      largest_tensor_numel=max(full_numel(p) for p in model.parameters()),
                      tensors_per_layer=max(len(list(layer.parameters())) for layer in layers), world_size=world_size)


def tensor_table(model: nn.Module, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, TensorInfo]:
    """Full element count and dtype of each parameter under `prefix`, skipping names under `skip`
    (ZeRO-3 partitioned parameters report their full size, `ds_numel`; meta ones their shape's)."""
    table = {}
    for name, param in model.named_parameters():
        if not name.startswith(prefix) or any(name.startswith(s + ".") for s in skip):
            continue
        table[name] = TensorInfo(full_numel(param), str(param.dtype).removeprefix("torch."))
    return table


def profiling_batch(micro_batch: int, seq_len: int, vocab_size: int, device: torch.device, seed: int) -> dict:
    """Random token ids with the last position of every row padded (labels ignored there), the way
    lazyzero's right-padded training rows look to the model."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len), generator=generator)
    mask = torch.ones_like(ids)
    mask[:, -1] = 0
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {key: value.to(device) for key, value in
            {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


@dataclass
class LayerCall:
    """The arguments the model passes one decoder layer; hidden states separate."""

    hidden_states: torch.Tensor
    args: tuple
    kwargs: dict
    returns_tuple: bool


@dataclass
class ModelCalls:
    """One forward of the model as its decoder layers saw it: each layer's call (by name, in order),
    the last layer's output, and whether every layer was fed exactly the previous layer's output
    (then the gradient at a layer's input is the gradient at the previous layer's output)."""

    calls: dict[str, LayerCall]
    last_output: torch.Tensor
    chained: bool


def capture_layer_calls(model: nn.Module, layers: dict[str, nn.Module], batch: dict,
                        device: torch.device | None = None) -> ModelCalls:
    """The model's forward on `batch` without autograd, one layer at a time (module docstring), on
    `device` (default: the batch's), keeping what each of `layers` was called with."""
    device = device or next(iter(batch.values())).device
    batch = {key: value.to(device) for key, value in batch.items()}
    names = list(layers)
    hidden, args, kwargs = _recorded_calls(model, names[:1], batch, device, stop_after_first=True)[names[0]]
    layer = materialized(layers[names[0]], model, device)
    returns_tuple = isinstance(_layer_output(layer, LayerCall(hidden, args, kwargs, False)), tuple)
    del layer
    recorded = _recorded_calls(model, names, batch, device, returns_tuple=returns_tuple)
    # Between layers the pass-through model hands each its predecessor's output (its own input): a
    # layer fed anything else sits behind a step of the model's own, which a replay would skip.
    chained = all(recorded[name][0] is recorded[previous][0] for previous, name in zip(names, names[1:]))
    calls, hidden = {}, recorded[names[0]][0]
    for name in names:
        _, args, kwargs = recorded[name]
        calls[name] = LayerCall(hidden.detach(), args, kwargs, returns_tuple)
        layer = materialized(layers[name], model, device)
        hidden = _first(_layer_output(layer, calls[name])).detach()
        del layer
    return ModelCalls(calls, hidden, chained)


class _FirstCallRecorded(Exception):
    """Ends the recording forward once the first decoder layer's arguments are known."""


def _recorded_calls(model: nn.Module, names: list[str], batch: dict, device: torch.device,
                    returns_tuple: bool = False, stop_after_first: bool = False) -> dict[str, tuple]:
    """name -> (hidden states, args, kwargs) each decoder layer in `names` receives in a forward of
    the embedding + head copy (`head_shell`), every decoder layer a pass-through."""
    shell = head_shell(model, list(decoder_layers(model)), returns_tuple, device)
    calls, caches = {}, {}

    def before(name, module, args, kwargs):
        # The model's cache fills up layer by layer: every call gets a copy of it as layer 0 saw it (empty).
        for key, value in kwargs.items():
            if isinstance(value, Cache) and key not in caches:
                caches[key] = _pristine(value)
        kwargs = {key: caches.get(key, value) for key, value in kwargs.items()}
        hidden = args[0] if args else kwargs.pop("hidden_states")
        calls[name] = (hidden, tuple(args[1:]), kwargs)
        if stop_after_first:
            raise _FirstCallRecorded

    handles = [shell.get_submodule(name).register_forward_pre_hook(functools.partial(before, name), with_kwargs=True)
               for name in names]
    try:
        with torch.no_grad():
            shell(**batch)
    except _FirstCallRecorded:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in names if name not in calls]
    if missing:
        raise RuntimeError(f"the model's forward never called its decoder layers {missing}")
    return calls


def _layer_output(layer: nn.Module, call: LayerCall):
    with torch.no_grad():
        return layer(call.hidden_states, *call.args, **_fresh_caches(call.kwargs))


def _pristine(value):
    return copy.deepcopy(value) if isinstance(value, Cache) else value


def _fresh_caches(kwargs: dict) -> dict:
    """The kwargs with a new copy of any (empty) cache: the model makes a new one every forward, and
    a decoder layer appends its keys and values to it."""
    return {key: copy.deepcopy(value) if isinstance(value, Cache) else value for key, value in kwargs.items()}


def _to_device(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def _in_shell(name: str, module: nn.Module) -> nn.Module:
    """An empty module holding `module` at the dotted path `name`."""
    root = parent = nn.Module()
    *path, last = name.split(".")
    for part in path:
        child = nn.Module()
        parent.add_module(part, child)
        parent = child
    parent.add_module(last, module)
    return root


def _first(output):
    return output[0] if isinstance(output, tuple) else output


class LayerBench:
    """One layer, its input and an output gradient, on `device`; runs forward + backward in the ways
    the profile needs. `forward(x)` returns the layer's output tensor. `grad_out`: the gradient its
    output gets (None: a made-up one, which is all that timing needs)."""

    def __init__(self, shell: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                 hidden: torch.Tensor | None, device: torch.device, seed: int, grad_out: torch.Tensor | None = None):
        self.shell, self.forward, self.device = shell, forward, device
        self.leaf = None if hidden is None else hidden.detach().clone().requires_grad_(True)
        if grad_out is not None:
            self.grad_out = grad_out.to(device)
            return
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            out = forward(self._input())
        # A loss gets the gradient 1, as from backward(); hidden states a small random one.
        grad = torch.ones(()) if out.dim() == 0 else torch.randn(out.shape, generator=generator) * 0.01
        self.grad_out = grad.to(out.dtype).to(device)

    def _input(self):
        # A fresh non-leaf each run, like the previous layer's output (the packer keeps leaves as they are).
        return None if self.leaf is None else self.leaf.clone()

    def _clear_grads(self) -> None:
        for param in self.shell.parameters():
            param.grad = None
        if self.leaf is not None:
            self.leaf.grad = None

    def _pass(self, forward, context=contextlib.nullcontext) -> tuple[float, float]:
        """(forward s, backward s) of one run; the forward inside `context()`, backward after it, as
        the engine runs them."""
        self._clear_grads()
        synchronize(self.device)
        start = time.perf_counter()
        with context():
            out = forward(self._input())
        synchronize(self.device)
        middle = time.perf_counter()
        out.backward(self.grad_out)
        synchronize(self.device)
        return middle - start, time.perf_counter() - middle

    def plain(self) -> tuple[float, ...]:
        return self._pass(self.forward)

    def packed(self, policy: ActivationPolicy) -> tuple[float, ...]:
        """One run under a new activation packer with `policy`, as a training forward runs."""
        packer = ActivationPacker(self.shell, policy, ActivationAccounting())
        try:
            return self._pass(self.forward, lambda: packer)
        finally:
            packer.remove()

    def gradients(self, policy: ActivationPolicy | None) -> list[torch.Tensor | None]:
        """The gradients of the input, then of every parameter that requires one (None where the
        output does not depend on it), from one forward (under a new packer with `policy`; None: no
        packer) and backward with `grad_out`. The parameters' own `.grad` stay untouched."""
        packer = None if policy is None else ActivationPacker(self.shell, policy, ActivationAccounting())
        try:
            with packer if packer is not None else contextlib.nullcontext():
                out = self.forward(self._input())
            wanted = [self.leaf] + [param for param in self.shell.parameters() if param.requires_grad]
            return list(torch.autograd.grad(out, wanted, self.grad_out, allow_unused=True))
        finally:
            if packer is not None:
                packer.remove()

    def checkpointed(self) -> tuple[float, ...]:
        """(forward s, backward s, recompute s) under torch's non-reentrant checkpoint (what per-layer
        recomputation uses); the function's second call is the recompute inside backward, timed even
        when the checkpoint stops it early, once everything backward needs is rebuilt."""
        calls: list[float] = []

        def timed_forward(x):
            start = time.perf_counter()
            try:
                return self.forward(x)
            finally:
                synchronize(self.device)
                calls.append(time.perf_counter() - start)

        return *self._pass(lambda x: checkpoint(timed_forward, x, use_reentrant=False)), calls[1]

    def saved_bytes(self, policy: ActivationPolicy) -> tuple[int, int]:
        """Bytes the packer stores for (the first, a second) forward inside one `with packer:`. Tensors
        the layer receives every time (rotary cos/sin, mask) are stored by the first only, as layer 0
        of a model stores them for all layers."""
        packer = ActivationPacker(self.shell, policy, ActivationAccounting())
        try:
            with packer:
                first_out = self.forward(self._input())
                first = packer.accounting.total().after
                packer.accounting.reset()
                second_out = self.forward(self._input())
        finally:
            packer.remove()
        del first_out, second_out
        return first, packer.accounting.total().after

    def transients(self) -> tuple[int | None, int | None]:
        """Temporaries of the forward and of the backward (see PhaseMemory.transient), after one
        untimed run (a layer's first backward allocates more than later ones)."""
        if self.device.type == "cpu" and not heap_sampling_available():
            return None, None
        self._pass(self.forward)
        self._clear_grads()
        held = {}
        forward = phase_memory(lambda: held.setdefault("out", self.forward(self._input())), self.device)
        backward = phase_memory(lambda: held.pop("out").backward(self.grad_out), self.device)
        self._clear_grads()
        return forward.transient, backward.transient


def interleaved_medians(modes: dict[str, Callable[[], tuple[float, ...]]], repeats: Repeats) -> dict[str, list[float]]:
    """Per mode, the median of each timing it returns. Modes run in turn (A, B, C, A, B, C, ...) so
    that load from other processes on a shared machine slows every mode alike and their differences
    (what packing adds) stay meaningful."""
    results: dict[str, list] = {name: [] for name in modes}
    for run in range(repeats.warmup + repeats.repeats):
        for name, mode in modes.items():
            timings = mode()
            if run >= repeats.warmup:
                results[name].append(timings)
    return {name: [statistics.median(column) for column in zip(*rows)] for name, rows in results.items()}


# The fields of an activation config that set how a layer at some default width stores what it saves.
# Overrides, recomputed and offloaded layers are per-layer choices the planner makes: left out.
WIDTH_RULE_FIELDS = ("attention_bits", "attention_input_bits", "attention_value_bits", "norm_bits", "block_size",
                     "keep_outliers", "stochastic_rounding", "recompute_elementwise")


def profiling_config(config: ActivationsConfig, bits: int) -> ActivationsConfig:
    """`config`'s width rules with `default_bits` = `bits`, for every layer alike."""
    return ActivationsConfig(default_bits=bits, **{name: getattr(config, name) for name in WIDTH_RULE_FIELDS})


def decoder_bench(model: nn.Module, name: str, call: LayerCall, device: torch.device, seed: int,
                  grad_out: torch.Tensor | None = None) -> LayerBench:
    """A whole copy of decoder layer `name`, alone, called as the model calls it."""
    layer = materialized(model.get_submodule(name), model, device, seed).train()
    shell = _in_shell(name, layer)
    args, kwargs = _to_device(call.args, device), _to_device(call.kwargs, device)
    return LayerBench(shell, lambda x: _first(layer(x, *args, **_fresh_caches(kwargs))), call.hidden_states.to(device),
                      device, seed, grad_out)


class PassThrough(nn.Module):
    """Stands in for a decoder layer: returns its hidden states (or `output`, when given) as the layer
    would return its output."""

    def __init__(self, returns_tuple: bool, output: torch.Tensor | None = None):
        super().__init__()
        self.returns_tuple, self.output = returns_tuple, output

    def forward(self, hidden_states, *args, **kwargs):
        result = hidden_states if self.output is None else self.output
        return (result,) if self.returns_tuple else result


@contextlib.contextmanager
def layers_replaced(model: nn.Module, stand_ins: dict[str, nn.Module]):
    """`model` with the modules named in `stand_ins` replaced by them until the block ends."""
    modules = dict(model.named_modules())
    originals = {name: modules[name] for name in stand_ins}
    try:
        for name, module in stand_ins.items():
            _replace(model, name, module)
        yield model
    finally:
        for name, module in originals.items():
            _replace(model, name, module)


def head_shell(model: nn.Module, layer_names: list[str], returns_tuple: bool, device: torch.device,
               seed: int = 0) -> nn.Module:
    """A whole copy of the model with pass-through decoder layers (embedding, set-up, final norm, head)."""
    with layers_replaced(model, {name: PassThrough(returns_tuple) for name in layer_names}):
        shell = materialized(model, model, device, seed)
    return shell.train()


def head_bench(model: nn.Module, layer_names: list[str], returns_tuple: bool, batch: dict,
               device: torch.device, seed: int) -> LayerBench:
    """A copy of the model with pass-through decoder layers; its "output" is the loss."""
    shell = head_shell(model, layer_names, returns_tuple, device, seed)
    forward = functools.partial(_loss_of, shell, batch)
    return LayerBench(shell, forward, None, device, seed)


def _loss_of(model: nn.Module, batch: dict, _unused_input) -> torch.Tensor:
    return model(**batch).loss


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, last = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent.add_module(last, module)


def layer_number(name: str) -> int:
    """The index of decoder layer `name` ("model.layers.3" -> 3)."""
    index = layer_index(name)
    if index is None:
        raise ValueError(f"{name!r} is not named like a decoder layer")
    return index


def offload_config(config: ActivationsConfig, layer: int, nvme_path: str) -> ActivationsConfig:
    """`config`'s width rules at 16 bits with decoder layer `layer`'s stored activations on NVMe."""
    rules = {name: getattr(config, name) for name in WIDTH_RULE_FIELDS}
    return ActivationsConfig(enabled=True, default_bits=16, offload_layers={str(layer): "nvme"},
                             offload_nvme_path=nvme_path, **rules)


def _measured(bits: int, decoder: bool) -> int:
    """The width whose measurement stands for `bits`: itself for a decoder layer, 16 for the head."""
    return bits if decoder else 16


def measure_layer(bench: LayerBench, repeats: Repeats, config: ActivationsConfig, decoder: bool,
                  measure_memory: bool, offload: tuple[int, str] | None = None) -> dict:
    """Every LayerProfile measurement of `bench` except names and tensors, as keyword arguments;
    also "shared_saved_bytes": per width, what the first forward stored beyond later ones.

    A decoder layer's act_bytes leave out what every layer receives (stored once per forward); the
    embedding + head gets a new batch every forward, so everything its first run stored counts.
    Only decoder layers are measured under recomputation. `offload`: (the layer's index, an NVMe
    folder) to also time it with its stored activations offloaded there (16 bits)."""
    # The head is never packed at other widths (problem_from_profile gives it its 16-bit bytes at
    # every width): measuring it at 8 and 4 bits took minutes for a 49152-token vocabulary, for nothing.
    widths = BIT_WIDTHS if decoder else (16,)
    policies = {bits: ActivationPolicy(profiling_config(config, bits)) for bits in widths}
    modes = {"plain": bench.plain,
             **{bits: functools.partial(bench.packed, policy) for bits, policy in policies.items()}}
    if decoder:
        modes["checkpoint"] = bench.checkpointed
    if decoder and offload is not None:
        modes["offload"] = functools.partial(bench.packed, ActivationPolicy(offload_config(config, *offload)))
    medians = interleaved_medians(modes, repeats)
    saved = {bits: bench.saved_bytes(policy) for bits, policy in policies.items()}
    (fwd_s, bwd_s), ckpt = medians["plain"], medians.get("checkpoint")
    transient_fwd, transient_bwd = bench.transients() if measure_memory else (None, None)
    output = bench.forward(bench._input()).detach() if bench.leaf is not None else None
    return {
        "fwd_s": fwd_s, "bwd_s": bwd_s, "recompute_s": ckpt[2] if ckpt else None,
        "checkpointed_fwd_s": ckpt[0] if ckpt else None, "checkpointed_bwd_s": ckpt[1] if ckpt else None,
        "packed_fwd_s": {bits: medians[_measured(bits, decoder)][0] for bits in BIT_WIDTHS},
        "packed_bwd_s": {bits: medians[_measured(bits, decoder)][1] for bits in BIT_WIDTHS},
        "act_bytes": {bits: saved[_measured(bits, decoder)][1 if decoder else 0] for bits in BIT_WIDTHS},
        "input_bytes": 0 if bench.leaf is None else bench.leaf.untyped_storage().nbytes(),
        "output_bytes": 0 if output is None else output.untyped_storage().nbytes(),
        "transient_fwd_bytes": transient_fwd, "transient_bwd_bytes": transient_bwd,
        "shared_saved_bytes": {bits: saved[_measured(bits, decoder)][0] - saved[_measured(bits, decoder)][1]
                               for bits in BIT_WIDTHS},
        "offloaded_fwd_s": medians["offload"][0] if "offload" in medians else None,
        "offloaded_bwd_s": medians["offload"][1] if "offload" in medians else None,
    }
