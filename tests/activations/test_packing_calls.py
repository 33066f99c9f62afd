"""What storing one saved tensor asks of the quant ops, and the look for non-finite blocks left to the
forward's end (lazyzero/activations/packing.py, finite_checks.py).

Runs on the CPU build of the dispatch. The fixture `device_path` makes the packer choose as it does on
a GPU (`DECIDE_AT_ONCE_ON` emptied): the kernels just run, and what is counted is what the packer asks
of them, native calls (`NativeCalls`, one kernel launch each on a GPU) and host reads (`HostReads`).
"""

import gc
import weakref
from dataclasses import dataclass

import pytest
import torch

from lazyzero.activations import ActivationPacker, ActivationPolicy, finite_checks, packing
from lazyzero.activations.config import ActivationsConfig
from lazyzero.models.build import build_model
from lazyzero.ops.quant import NativeCalls, quantize_blockwise
from lazyzero.testing import HostReads

# default: q and k by channel; attention-8: every tensor of the attention in blocks along the storage,
# with block outliers, looked at for non-finite blocks.
POLICIES = {"default": ActivationsConfig(), "attention-8": ActivationsConfig(overrides={"*.self_attn": 8})}
MAX_NATIVE_CALLS_PER_TENSOR = 2


@pytest.fixture
def device_path(monkeypatch):
    monkeypatch.setattr(finite_checks, "DECIDE_AT_ONCE_ON", ())


@dataclass
class Stored:
    """One `_store` call: how the tensor was stored, and what that asked for."""

    bits: int
    check_finite: bool
    by_channel: bool
    form: object
    native_calls: int
    host_reads: int


def stores_in_a_forward(config: ActivationsConfig, monkeypatch) -> tuple[list[Stored], int]:
    """Every `_store` of one forward of a tiny Llama packed under `config`, and how many times the
    checks left to the forward's end were read back."""
    model = build_model("tiny", "llama", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    stores, resolves = [], []
    store, counts = packing.ActivationPacker._store, finite_checks.nonfinite_block_counts

    def counting_store(self, root, bits, entry, check_finite, by_channel=False):
        with NativeCalls() as calls, HostReads(root.device.type) as reads:
            form, kept = store(self, root, bits, entry, check_finite, by_channel)
        stores.append(Stored(bits, check_finite, by_channel, form, calls.total, reads.count))
        return form, kept

    def counting_reads(forms):
        resolves.append(len(forms))
        return counts(forms)

    monkeypatch.setattr(packing.ActivationPacker, "_store", counting_store)
    monkeypatch.setattr(finite_checks, "nonfinite_block_counts", counting_reads)
    with ActivationPacker(model, ActivationPolicy(config)):
        model(ids)
    return stores, resolves


@pytest.mark.parametrize("policy", POLICIES)
def test_a_stored_tensor_costs_one_native_call_and_no_host_read(device_path, monkeypatch, policy):
    stores, resolves = stores_in_a_forward(POLICIES[policy], monkeypatch)
    quantized = [stored for stored in stores if stored.bits < 16]
    assert all(stored.native_calls <= MAX_NATIVE_CALLS_PER_TENSOR and stored.host_reads == 0 for stored in quantized)
    assert all(stored.native_calls == 1 for stored in quantized)  # measured: one each way
    looked_at = [stored for stored in quantized if stored.check_finite]
    if policy == "default":
        assert any(stored.by_channel for stored in quantized) and not looked_at and resolves == []
    else:
        assert looked_at and all(isinstance(stored.form, finite_checks.PendingFinite) for stored in looked_at)
        assert resolves == [len(looked_at)]  # every check of the forward in one read, when it ends
        assert all(stored.form.resolved for stored in looked_at)


def test_on_the_cpu_the_check_is_read_at_once(monkeypatch):
    stores, resolves = stores_in_a_forward(POLICIES["attention-8"], monkeypatch)
    looked_at = [stored for stored in stores if stored.check_finite]
    assert looked_at and all(stored.host_reads == 1 for stored in looked_at) and resolves == []


def gradients_and_bytes(model, config: ActivationsConfig):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    packer = ActivationPacker(model, ActivationPolicy(config))
    with packer:
        loss = model(ids).logits.float().pow(2).mean()
    loss.backward()
    packer.remove()
    by_kind = {kind: (cell.before, cell.after, cell.tensors) for kind, cell in packer.accounting.by_kind().items()}
    return {name: param.grad.clone() for name, param in model.named_parameters()}, by_kind


def test_checks_left_to_the_end_store_what_checks_at_once_store(monkeypatch):
    model = build_model("tiny", "llama", seed=0)
    at_once, at_once_bytes = gradients_and_bytes(model, POLICIES["attention-8"])
    monkeypatch.setattr(finite_checks, "DECIDE_AT_ONCE_ON", ())
    at_end, at_end_bytes = gradients_and_bytes(model, POLICIES["attention-8"])
    assert at_end_bytes == at_once_bytes
    for name, grad in at_once.items():
        torch.testing.assert_close(at_end[name], grad, rtol=0, atol=0)


class MaskedSine(torch.nn.Module):
    """sin(x masked): `sin` saves its input, which holds -inf where `mask` is set (a fully masked row's
    logsumexp is -inf)."""

    def forward(self, x, mask):
        masked = (x * 2.0).masked_fill(mask, float("-inf"))
        self.last_input = weakref.ref(masked)
        return torch.sin(masked)


def saved_inputs(mask_rows: list[int], unpack_inside: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(the input `sin` saved, as backward gets it; the exact one; whether that input's tensor object
    outlived the forward pass) for an attention-kind module whose input has rows `mask_rows` of 64
    elements set to -inf."""
    model = torch.nn.ModuleDict({"self_attn": MaskedSine()})
    packer = ActivationPacker(model, ActivationPolicy(ActivationsConfig(overrides={"self_attn": 8})))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    mask = torch.zeros(8, 64, dtype=torch.bool)
    mask[mask_rows] = True
    exact = (x.detach() * 2.0).masked_fill(mask, float("-inf"))
    with packer:
        out = model["self_attn"](x, mask)
        if unpack_inside:
            return out.grad_fn._saved_self, exact, True
    gc.collect()
    outlived = model["self_attn"].last_input() is not None
    return out.grad_fn._saved_self, exact, outlived


@pytest.mark.parametrize("unpack_inside", [False, True], ids=["after-forward", "inside-forward"])
def test_a_tensor_with_a_non_finite_block_comes_back_exact(device_path, unpack_inside):
    saved, exact, _ = saved_inputs([2, 5], unpack_inside)
    assert torch.equal(saved, exact)


def test_a_finite_tensor_comes_back_quantized_and_is_freed_when_the_forward_ends(device_path):
    saved, exact, outlived = saved_inputs([])
    assert not outlived  # referenced only until its check was read
    assert not torch.equal(saved, exact)
    torch.testing.assert_close(saved, exact, rtol=0, atol=float(exact.abs().max()) / 127)


def test_non_finite_blocks_are_counted_per_form_in_one_read():
    x = torch.randn(3, 256)
    x[1, 3], x[1, 200], x[2, 70] = float("nan"), float("inf"), float("-inf")
    x[2, 71] = float("inf")  # with the -inf in one block: its outlier is one of them, the other remains
    forms = [quantize_blockwise(row, bits=8, block_size=64, keep_outliers=True) for row in x]
    forms[1] = quantize_blockwise(x[1], bits=4, block_size=64)
    assert finite_checks.nonfinite_block_counts(forms) == [0, 2, 1]
