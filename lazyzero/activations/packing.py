"""Saved-tensor packing: the tensors autograd saves inside a module are stored at that module's width.

`ActivationPacker` registers forward pre/post hooks on the modules the policy names, which keep a
stack of the modules being run; inside `with packer:` a `saved_tensors_hooks` pair stores each saved
tensor at the width of the innermost of them (block-wise int8 or packed int4 with fp32 scales, from
`lazyzero.ops.quant`) and restores it in backward. Kept as they are, and why:
- parameters and views of them (Linear saves its weight), and leaves that require grad: they live
  anyway, so a packed copy would only add memory;
- integer, bool and fp64 tensors (no quantizer for them; masks and indices are small);
- tensors of fewer elements than one block (the scale would cost more than it saves);
- a view whose dtype differs from its base's (quantizing the base would not restore it).

Packing works on storages, not on tensor objects: the q, k and v projections each save their own
view of one input, SDPA saves its output and o_proj a reshaped view of it. The first save of a
storage quantizes the whole storage once; every later view of it (at the same width) refers to that
packed form and is rebuilt with `as_strided` in backward. So no tensor is stored twice, packed or
not, and once a storage is kept unpacked (a 16-bit module saved it) later saves keep it too: packing
it as well would only add a copy. Nothing refers to the original tensor once it is packed, so its
memory is freed as soon as the forward pass drops it.

Some tensors need not be stored at all: `derive(output, fn, *sources)` records that `output` is
`fn(*sources)` for sources already stored, so a later save of `output` keeps only that recipe and
backward recomputes it from the sources' stored forms (the product inside a gated MLP, see
`lazyzero/activations/rewrites.py`). Such a tensor counts 0 bytes after packing. The recipe
is used only where its sources are stored at least as wide as the saving module's width: a 16-bit
module keeps the exact tensor, an 8-bit one does not take a recipe over 4-bit sources.

Inside attention a tensor with a block that is not finite is kept exact; on a GPU that is decided
for all of them when the forward pass ends, in one host read (lazyzero/activations/finite_checks.py).

Composes with activation checkpointing: torch's checkpoint pushes its own saved-tensor hooks inside
ours, so what it recomputes never reaches the packer, and the policy gives recomputed layers 16 bits.

Layers in `offload_layers` hand each stored form (packed, or a storage kept as saved) to an
`ActivationOffloader` right after storing it; autograd then holds the form's `OffloadedStorage`,
which reads it back in backward (lazyzero/activations/offload.py).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from lazyzero.activations import loss_head, rewrites
from lazyzero.activations.accounting import ActivationAccounting
from lazyzero.activations.attention_values import AttentionRoles
from lazyzero.activations.by_channel import ChannelBlocked, quantize_by_channel
from lazyzero.activations.finite_checks import FiniteChecks, PendingFinite, decides_at_once, has_nonfinite_block
from lazyzero.activations.offload import ActivationOffloader, OffloadedStorage
from lazyzero.activations.offload_io import AioSettings
from lazyzero.activations.policy import KEEP_BITS, ActivationPolicy, ModuleBits
from lazyzero.activations.stored import DerivedStorage, PackedView, storage_root, unpack_for_autograd
from lazyzero.ops.quant import SUPPORTED_DTYPES, BlockQuantized, quantize_blockwise


@dataclass
class _StoredStorage:
    """The forms (width -> packed storage, or None when kept as it is; either may be offloaded) of one
    storage seen in this forward pass, or the recipe that recomputes it (`derived`)."""

    root: weakref.ref
    version: int
    forms: dict[int, BlockQuantized | ChannelBlocked | OffloadedStorage | PendingFinite | None] = field(
        default_factory=dict)
    derived: DerivedStorage | None = None
    derived_counted: bool = False


class ActivationPacker:
    """Stores saved activations at the width `policy` gives the innermost managed module around them.

    Usage: `with packer: loss = model(batch)`, then `loss.backward()` (outside or inside). Module hooks
    stay registered until `remove()`; packing happens only inside the `with` block. Byte counts go to
    `packer.accounting` (see `ActivationAccounting`). With `offload_layers`, `packer.offloader` moves
    those layers' forms (`rank` and `aio`: see `ActivationOffloader`), and `close()` ends it.
    """

    def __init__(self, model: nn.Module, policy: ActivationPolicy, accounting: ActivationAccounting | None = None,
                 *, rank: int | None = None, aio: AioSettings | None = None):
        self.policy = policy
        self.accounting = accounting if accounting is not None else ActivationAccounting()
        self.offloader = None
        if policy.config.offload_layers:
            self.offloader = ActivationOffloader(model, policy.config, self.accounting, lambda: self.active,
                                                 rank=rank, aio=aio)
        self.managed = policy.plan(model)
        # (entry, module, the root of its input when the entry stores that input at its own width,
        # the attention's roles when it stores its values at their own width)
        self._scopes: list[tuple[ModuleBits, nn.Module, torch.Tensor | None, AttentionRoles | None]] = []
        self._stored: dict[int, _StoredStorage] = {}
        self._seed = 0
        self._finite_checks = FiniteChecks(self._settle)
        self._active: list[torch.autograd.graph.saved_tensors_hooks] = []
        modules = dict(model.named_modules())
        self._handles = []
        for entry in self.managed:
            self._manage(modules[entry.name], entry)
        self._rewritten = self._install_rewrites(modules) if policy.config.recompute_elementwise else []
        self._model = model
        if getattr(getattr(model, "config", None), "use_cache", None) is not None:
            self._handles.append(model.register_forward_pre_hook(self._without_kv_cache, with_kwargs=True))
        self.fused_loss = policy.config.fused_loss and loss_head.install_fused_loss(model)
        if self.fused_loss:
            self._manage_loss_head(model, modules)

    def _manage(self, module: nn.Module, entry: ModuleBits) -> None:
        """Tensors saved while `module` runs (and no managed module inside it) are stored at `entry`'s width."""
        self._handles.append(module.register_forward_pre_hook(functools.partial(self._enter_module, entry),
                                                              with_kwargs=True))
        # always_call: an exception inside forward must not leave the module on the stack.
        self._handles.append(
            module.register_forward_hook(functools.partial(self._exit_module, entry), always_call=True)
        )

    def _manage_loss_head(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        """The fused loss head holds its weight gradient and the hidden states' gradient from forward to
        backward (lazyzero/activations/loss_head.py): the first is stored at the policy's width for the
        head, the second kept exact (`_pack`)."""
        head = model.get_output_embeddings()
        name = next(name for name, module in modules.items() if module is head)
        entry = self.policy.loss_head_entry(name)
        self.managed.append(entry)
        self._manage(head, entry)

    def _without_kv_cache(self, model: nn.Module, args, kwargs):
        """A transformers model called for training builds a KV cache unless told not to (its config's
        `use_cache`), which holds every layer's k and v as computed until the forward pass returns: a
        second copy of what is stored packed for backward, and the peak of a step that stores its values
        at 8 bits. Inside `with packer:` a call that says nothing of the cache builds none."""
        if self.active and "use_cache" not in kwargs and "past_key_values" not in kwargs:
            return args, {**kwargs, "use_cache": False}
        return None

    def _install_rewrites(self, modules: dict[str, nn.Module]) -> list[nn.Module]:
        """Norms and gated MLPs below 16 bits store fewer tensors (lazyzero/activations/rewrites.py)."""
        rewritten = []
        for entry in self.managed:
            module = modules[entry.name]
            if entry.bits == KEEP_BITS:
                continue
            if entry.kind == "norm":
                rewrites.recompute_from_input(module, self)
            elif entry.kind == "mlp" and rewrites.is_gated_mlp(module):
                rewrites.derive_gated_product(module, self)
            else:
                continue
            rewritten.append(module)
        return rewritten

    def __enter__(self) -> ActivationPacker:
        if not self._active and self.offloader is not None:
            self.offloader.begin_forward()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack_for_autograd)
        hooks.__enter__()
        self._active.append(hooks)
        return self

    def __exit__(self, *exc_info) -> None:
        self._active.pop().__exit__(*exc_info)
        if not self._active:
            self._finite_checks.resolve()  # one host read for the forward pass (finite_checks.py)
            # Only this forward pass can save these tensors again; autograd holds the packed forms.
            self._stored.clear()
            if self.offloader is not None:
                self.offloader.end_forward()

    def remove(self) -> None:
        """Unregister the module hooks (what is stored already can still be unpacked)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._rewritten:
            rewrites.restore_forward(module)
        self._rewritten.clear()
        if self.fused_loss:
            loss_head.remove_fused_loss(self._model)
            self.fused_loss = False
        if self.offloader is not None:
            self.offloader.remove()

    def close(self) -> None:
        """`remove()`, and end the offload: its files deleted, its buffers freed (see `ActivationOffloader.close`)."""
        self.remove()
        if self.offloader is not None:
            self.offloader.close()

    @property
    def active(self) -> bool:
        """Inside `with packer:` with autograd recording (the only time tensors get saved)."""
        return bool(self._active) and torch.is_grad_enabled()

    def store(self, tensor: torch.Tensor):
        """What the pack hook would give autograd for `tensor` (the tensor itself outside `with
        packer:`), for a backward function that keeps it on its ctx: unpack it with `unpack_saved`;
        a PackedView unpacks to a buffer of its own, which that function may overwrite."""
        return self._pack(tensor) if self.active else tensor

    def derive(self, output: torch.Tensor, fn: Callable[..., torch.Tensor], *sources: torch.Tensor,
               fn_in_place: Callable[..., torch.Tensor] | None = None) -> None:
        """Record that `output` equals `fn(*sources)`; a later save of it stores only this recipe
        (`fn_in_place`: the same result written into the first source, see `DerivedStorage`).

        Every source must already be stored in this forward pass (saved by an earlier operation),
        else nothing is recorded and `output` is packed as usual when saved. `fn` must rebuild
        `output` from the sources as stored (dequantized when packed).
        """
        if not self.active or output._base is not None or not output.is_contiguous():
            return
        forms = [self._stored_form(source) for source in sources]
        if any(form is None for form in forms):
            return
        self._stored_for(output).derived = DerivedStorage(fn, tuple(forms), fn_in_place)

    def _stored_form(self, tensor: torch.Tensor):
        """What backward will hold for `tensor`: itself when kept, a PackedView of it, or None if unsaved."""
        stored = self._current(storage_root(tensor))
        if stored is None:
            return None
        if KEEP_BITS in stored.forms:
            kept = stored.forms[KEEP_BITS]
            return tensor if kept is None else PackedView.of(kept, tensor)
        if stored.derived is not None:
            return PackedView.of(stored.derived, tensor)
        packed = next((form for form in stored.forms.values() if form is not None), None)
        return PackedView.of(packed, tensor) if packed is not None else None

    def _enter_module(self, entry: ModuleBits, module: nn.Module, args, kwargs) -> None:
        module_input = _first_tensor(args, kwargs) if entry.input_bits is not None else None
        wants_roles = entry.value_bits is not None or entry.query_key_bits is not None
        roles = AttentionRoles() if wants_roles and self.active else None
        if roles is not None:
            roles.__enter__()
        self._scopes.append((entry, module, None if module_input is None else storage_root(module_input), roles))

    def _exit_module(self, entry: ModuleBits, module: nn.Module, args, output) -> None:
        top, _, _, roles = self._scopes.pop()
        if roles is not None:
            roles.__exit__(None, None, None)
        if top is not entry:
            raise RuntimeError(f"activation packer: module {entry.name!r} ended while {top.name!r} was running")

    def _pack(self, tensor: torch.Tensor):
        entry, module, module_input, roles = self._scopes[-1] if self._scopes else (None, None, None, None)
        if _aliases_parameter(tensor, module):
            return tensor
        root = storage_root(tensor)
        bits = entry.bits if entry else KEEP_BITS
        # Only inside attention, apart from its input, value and output, does a finite forward pass
        # save infinities (SDPA's logsumexp is -inf on fully masked rows): only there does `_store`
        # look for blocks that are not finite (lazyzero/activations/finite_checks.py). Anywhere else
        # an infinity means the loss is not finite either.
        inside_attention = entry is not None and entry.kind == "attention"
        by_channel = False
        if root is module_input:
            bits, inside_attention = entry.input_bits, False
        elif roles is not None and entry.value_bits is not None and roles.is_value(tensor):
            bits, inside_attention = entry.value_bits, False
        elif roles is not None and entry.query_key_bits is not None and roles.is_query_or_key(tensor):
            bits, inside_attention, by_channel = entry.query_key_bits, False, True
        if entry is not None and entry.kind == "head" and not _is_weight_gradient(tensor, module):
            bits = KEEP_BITS  # the hidden states' gradient: small, and every layer's backward starts from it
        if not self._packable(tensor):
            bits = KEEP_BITS
        stored = self._stored_for(root)
        if KEEP_BITS in stored.forms:
            kept = stored.forms[KEEP_BITS]
            return tensor if kept is None else PackedView.of(kept, tensor)
        if stored.derived is not None and stored.derived.bits >= bits:
            if not stored.derived_counted:
                stored.derived_counted = True
                layer, kind = (entry.layer, entry.kind) if entry else (None, None)
                self.accounting.record(layer, kind, root.untyped_storage().nbytes(), 0)
            return PackedView.of(stored.derived, tensor)
        if bits not in stored.forms:
            form, kept = self._store(root, bits, entry, check_finite=inside_attention, by_channel=by_channel)
            stored.forms[bits] = form
            if kept:
                stored.forms[KEEP_BITS] = form  # kept exact: every later save refers to it (or its offloaded copy)
        form = stored.forms[bits]
        return tensor if form is None else PackedView.of(form, tensor)

    def _packable(self, tensor: torch.Tensor) -> bool:
        return (
            tensor.dtype in SUPPORTED_DTYPES
            and tensor.dtype == storage_root(tensor).dtype
            and tensor.numel() >= self.policy.config.block_size
        )

    def _current(self, root: torch.Tensor) -> _StoredStorage | None:
        """`root`'s entry of this forward pass, or None. A root changed in place since its first
        save holds other values, and a dead root's id may belong to another tensor: neither counts."""
        stored = self._stored.get(id(root))
        if stored is None or stored.root() is not root or stored.version != root._version:
            return None
        return stored

    def _stored_for(self, root: torch.Tensor) -> _StoredStorage:
        """`root`'s current entry, a new one when it has none (see `_current`)."""
        stored = self._current(root)
        if stored is None:
            key = id(root)
            stored = _StoredStorage(weakref.ref(root, functools.partial(self._forget, key)), root._version)
            self._stored[key] = stored
        return stored

    def _forget(self, key: int, _dead_ref) -> None:
        # The root's Python object died: its id may be reused by an unrelated tensor.
        self._stored.pop(key, None)

    def _store(self, root: torch.Tensor, bits: int, entry: ModuleBits | None, check_finite: bool,
               by_channel: bool = False) -> tuple[object, bool]:
        """Store `root`'s whole storage at `bits` (`by_channel`: in blocks along tokens, where its layout
        allows; `check_finite`: exact where a block is not finite), off the device if its layer offloads,
        and record the bytes: (the form, None when kept as it is; whether it is kept exact rather than
        packed). Where that check is left for later, the form is a `PendingFinite` (not kept exact)."""
        layer, kind = (entry.layer, entry.kind) if entry else (None, None)
        if bits != KEEP_BITS and by_channel:
            form = self._store_by_channel(root, bits, layer, kind)
            if form is not None:
                return form, False
        if bits == KEEP_BITS:
            return self._store_kept(root, layer, kind), True
        packed = self._quantize(root, bits)
        if not check_finite:
            return self._store_packed(root, packed, layer, kind), False
        if not decides_at_once(root):
            return self._finite_checks.add(packed, _flat_storage(root), root, layer, kind), False
        if has_nonfinite_block(packed):
            return self._store_kept(root, layer, kind), True
        return self._store_packed(root, packed, layer, kind), False

    def _settle(self, pending: PendingFinite, nonfinite: bool):
        """Store a `PendingFinite` once its check is read: exact when `nonfinite`, else packed."""
        root, layer, kind = pending.settle_args
        if nonfinite:
            return self._store_kept(root, layer, kind)
        return self._store_packed(root, pending.packed, layer, kind)

    def _store_kept(self, root: torch.Tensor, layer: int | None, kind) -> OffloadedStorage | None:
        """`root` kept exact: its offloaded copy, or None when it stays as it is."""
        before = root.untyped_storage().nbytes()
        form = self.offloader.offload_kept(root, layer) if self.offloader is not None else None
        self.accounting.record(layer, kind, before, before, offloaded=before if form is not None else 0)
        return form

    def _store_packed(self, root: torch.Tensor, packed: BlockQuantized, layer: int | None, kind):
        """`root` stored as `packed`: it, or its offloaded copy."""
        after = packed.nbytes
        offloaded = self.offloader.offload_packed(packed, layer) if self.offloader is not None else None
        self.accounting.record(layer, kind, root.untyped_storage().nbytes(), after,
                               offloaded=after if offloaded is not None else 0)
        return packed if offloaded is None else offloaded

    def _store_by_channel(self, root: torch.Tensor, bits: int, layer: int | None, kind) -> ChannelBlocked | None:
        """`_store` of an attention call's query or key in centred blocks along tokens
        (lazyzero/activations/by_channel.py): its form, or None where its layout is not tokens by
        channels (then `_store` packs it in blocks along the storage)."""
        config = self.policy.config
        self._seed += 1
        form = quantize_by_channel(root.detach(), bits, config.block_size, config.stochastic_rounding, self._seed)
        if form is None:
            return None
        after, codes_bytes = form.nbytes, form.codes.nbytes
        offloaded = self.offloader.offload_packed(form.codes, layer) if self.offloader is not None else None
        if offloaded is not None:
            form = dataclasses.replace(form, codes=offloaded)
        self.accounting.record(layer, kind, root.untyped_storage().nbytes(), after,
                               offloaded=codes_bytes if offloaded is not None else 0)
        return form

    def _quantize(self, root: torch.Tensor, bits: int) -> BlockQuantized:
        """`root`'s whole storage block-quantized at `bits`."""
        config = self.policy.config
        self._seed += 1
        return quantize_blockwise(_flat_storage(root), bits=bits, block_size=config.block_size,
                                  stochastic=config.stochastic_rounding, seed=self._seed,
                                  keep_outliers=config.keep_outliers)


def _flat_storage(root: torch.Tensor) -> torch.Tensor:
    """The elements of `root`'s whole storage, flat, as a view."""
    numel = root.untyped_storage().nbytes() // root.element_size()
    return root.detach().as_strided((numel,), (1,), 0)


def _is_weight_gradient(tensor: torch.Tensor, head: nn.Module) -> bool:
    """Whether `tensor`, saved inside the fused loss head, is its weight's gradient ([out, in] of the
    Linear, whatever ZeRO-3 holds of the weight itself)."""
    return tuple(tensor.shape) == (head.out_features, head.in_features)


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A module call's input: its first tensor argument, else its `hidden_states` keyword (how
    transformers' decoder layers call their attention)."""
    first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
    return first if first is not None else kwargs.get("hidden_states")


def _aliases_parameter(tensor: torch.Tensor, module: nn.Module | None) -> bool:
    """Whether `tensor` is a parameter, a view of one, or shares storage with one of `module`'s.

    The storage test catches frozen parameters and ZeRO-3's gathered ones (swapped in as `.data`
    just before the module runs, which is why it is done at save time and not ahead).
    """
    root = storage_root(tensor)
    if isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad):
        return True
    if module is None:
        return False
    pointer = tensor.untyped_storage().data_ptr()
    return pointer != 0 and any(param.untyped_storage().data_ptr() == pointer for param in module.parameters())
