"""Offload of stored activations to NVMe with prefetch (lazyzero/activations/offload.py, docs/plan.md).

The tiny Llama (2 decoder layers) runs forward and backward under the packer with layers offloaded
to files under a test folder, against the same policy without offload: the bytes that come back are
the bytes that left, so gradients must be bit-equal. The NVMe path runs DeepSpeed's real async I/O
op (libaio); failures are injected through the file system, not mocks. The engine with a layer
on NVMe (2 ranks, ZeRO-3) is tested in test_engine_activations.py.
"""

import gc
import os
import shutil
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from lazyzero.activations import ActivationPacker, ActivationPolicy
from lazyzero.activations import offload as offload_module
from lazyzero.activations.config import ActivationsConfig
from lazyzero.models.build import build_model

BATCH, SEQ = 4, 64
needs_libaio = pytest.mark.skipif(not Path("/usr/include/libaio.h").exists(),
                                  reason="NVMe offload needs libaio-dev (.ci/run installs it)")
POLICIES = {  # bits -> the policy without offload
    16: ActivationsConfig(enabled=True, default_bits=16, attention_bits=16, norm_bits=16),
    8: ActivationsConfig(enabled=True, default_bits=8, attention_bits=8),
    4: ActivationsConfig(enabled=True),
}


def offloaded(config: ActivationsConfig, root, layers=(0, 1), tier="nvme", prefetch=1) -> ActivationsConfig:
    return config.model_copy(update={"offload_layers": {layer: tier for layer in layers},
                                     "offload_nvme_path": str(root), "offload_prefetch_layers": prefetch})


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def run_step(config: ActivationsConfig, before_backward=None):
    """Gradients of one forward and backward of the tiny Llama under a packer for `config`, and the
    packer (still open). `before_backward(packer, loss)` runs between the two."""
    model = build_model("tiny", seed=0)
    ids = token_ids(model.config.vocab_size)
    packer = ActivationPacker(model, ActivationPolicy(config))
    with packer:
        loss = model(input_ids=ids, labels=ids).loss
    try:
        if before_backward is not None:
            before_backward(packer, loss)
        loss.backward()
    except BaseException:
        del loss
        packer.close()
        raise
    return {name: param.grad.clone() for name, param in model.named_parameters()}, packer


@pytest.fixture
def nvme_root(tmp_path):
    root = tmp_path / "nvme"
    root.mkdir()
    return root


@needs_libaio
@pytest.mark.parametrize("bits", [16, 8, 4])
def test_gradients_with_layers_on_nvme_are_bit_equal_to_the_same_policy_kept(nvme_root, bits):
    expected, kept = run_step(POLICIES[bits])
    kept.close()
    found, packer = run_step(offloaded(POLICIES[bits], nvme_root))
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, atol=0, rtol=0, msg=name)
    layers = packer.accounting.by_layer()
    io = packer.offloader.take_io_stats()
    packer.close()
    # Both layers sent most of what they store (not forms under MIN_OFFLOAD_BYTES), the rest none.
    for layer in (0, 1):
        assert layers[layer].offloaded > 0.9 * layers[layer].after, layers[layer]
    assert layers[None].offloaded == 0  # embeddings, final norm, loss: outside the decoder layers
    # What came back is what left: the offloaded bytes, plus up to 3 bytes of padding per form
    # before its scales (PackedLayout).
    offloaded_bytes = sum(cell.offloaded for cell in layers.values())
    reads = io["reads_ahead"] + io["reads_own"] + io["reads_unpack"]
    assert io["read_bytes"] == io["written_bytes"]
    assert offloaded_bytes <= io["written_bytes"] <= offloaded_bytes + 3 * reads
    assert os.listdir(nvme_root) == []


@pytest.fixture
def handed_over(monkeypatch):
    """Weak references to what the packer handed to the offloader: (tensors moved off, tensors kept)."""
    moved, kept = [], []
    original_packed = offload_module.ActivationOffloader.offload_packed
    original_kept = offload_module.ActivationOffloader.offload_kept

    def spy_packed(self, packed, layer):
        result = original_packed(self, packed, layer)
        (moved if result is not None else kept).extend([weakref.ref(packed.codes), weakref.ref(packed.scales)])
        return result

    def spy_kept(self, root, layer):
        result = original_kept(self, root, layer)
        (moved if result is not None else kept).append(weakref.ref(root))
        return result

    monkeypatch.setattr(offload_module.ActivationOffloader, "offload_packed", spy_packed)
    monkeypatch.setattr(offload_module.ActivationOffloader, "offload_kept", spy_kept)
    return moved, kept


@needs_libaio
@pytest.mark.parametrize("bits", [16, 4])
def test_offloaded_forms_leave_memory_once_copied(nvme_root, handed_over, bits):
    moved, kept = handed_over

    def check_memory(packer, loss):
        gc.collect()
        assert moved and all(ref() is None for ref in moved), "an offloaded tensor is still referenced"
        # The control: what stayed (tiny forms) is still held by autograd, so the check above can fail.
        assert kept and any(ref() is not None for ref in kept)
        # Nor do the staging buffers keep those bytes once the writes are done.
        packer.offloader.flush()
        assert packer.offloader._nvme.pool.allocated_bytes == 0

    _, packer = run_step(offloaded(POLICIES[bits], nvme_root), check_memory)
    pool = packer.offloader._nvme.pool
    peak = packer.offloader.take_io_stats()["buffer_peak_bytes"]
    packer.offloader.flush()
    assert peak > 0 and pool.allocated_bytes == 0  # the read buffers go once backward has used them
    packer.close()


def run_step_holding_layer_1_backward(config: ActivationsConfig):
    """`run_step` with compute slower than the disk, made deterministic: a hook on the gradient of
    layer 1's output, run after the offloader's (registered earlier), blocks until every read asked
    so far is done, before layer 1's backward computes."""
    model = build_model("tiny", seed=0)
    packer = ActivationPacker(model, ActivationPolicy(config))
    outputs = []
    handle = model.model.layers[1].register_forward_hook(lambda module, args, output: outputs.append(output))
    ids = token_ids(model.config.vocab_size)
    with packer:
        loss = model(input_ids=ids, labels=ids).loss
    handle.remove()
    outputs[0].register_hook(lambda grad: packer.offloader.flush())
    loss.backward()
    return packer


@needs_libaio
def test_prefetch_reads_the_layer_below_before_its_backward_asks(nvme_root):
    packer = run_step_holding_layer_1_backward(offloaded(POLICIES[4], nvme_root, layers=(0,)))
    forms = len(packer.offloader._pass.by_layer[0])
    io = packer.offloader.take_io_stats()
    # Every read of layer 0 was asked when layer 1's backward started, none by an unpack...
    assert forms > 3 and (io["reads_ahead"], io["reads_own"], io["reads_unpack"]) == (forms, 0, 0)
    # ... so that with compute slower than the disk no unpack waited.
    assert packer.accounting.offload_waits == 0
    packer.close()


@needs_libaio
def test_without_prefetch_each_form_is_read_when_backward_asks(nvme_root):
    packer = run_step_holding_layer_1_backward(offloaded(POLICIES[4], nvme_root, layers=(0,), prefetch=0))
    forms = len(packer.offloader._pass.by_layer[0])
    io = packer.offloader.take_io_stats()
    assert forms > 3 and (io["reads_ahead"], io["reads_own"], io["reads_unpack"]) == (0, 0, forms)
    assert 0 < packer.accounting.offload_waits <= forms
    packer.close()


@needs_libaio
def test_a_failed_write_is_raised_in_backward_naming_the_file(nvme_root):
    model = build_model("tiny", seed=0)
    packer = ActivationPacker(model, ActivationPolicy(offloaded(POLICIES[4], nvme_root, layers=(0,))))
    shutil.rmtree(packer.offloader._nvme.folder)  # after start: every write's open fails (ENOENT)
    ids = token_ids(model.config.vocab_size)
    with packer:
        loss = model(input_ids=ids, labels=ids).loss
    with pytest.raises(OSError, match=r"activation offload: writing .*_layer0\.act failed: .*No such file"):
        loss.backward()
    packer.close()  # the rest of that burst was reported with the first error
    assert os.listdir(nvme_root) == []


@needs_libaio
def test_a_truncated_file_is_raised_at_the_unpack_that_reads_it(nvme_root):
    def truncate_one_file(packer, loss):
        packer.offloader.flush()  # the forward's writes are on disk
        (name,) = sorted(os.listdir(packer.offloader._nvme.folder))[-1:]
        path = os.path.join(packer.offloader._nvme.folder, name)
        os.truncate(path, 100)

    with pytest.raises(OSError, match=r"activation offload: reading .*\.act failed: .*truncated"):
        run_step(offloaded(POLICIES[4], nvme_root), truncate_one_file)
    assert os.listdir(nvme_root) == []


@needs_libaio
def test_an_error_no_unpack_meets_is_raised_by_the_next_forward(nvme_root):
    config = offloaded(POLICIES[4], nvme_root, layers=(0,))
    model = build_model("tiny", seed=0)
    packer = ActivationPacker(model, ActivationPolicy(config))
    shutil.rmtree(packer.offloader._nvme.folder)
    ids = token_ids(model.config.vocab_size)
    with packer:
        model(input_ids=ids, labels=ids)  # graph dropped: no backward
    packer.offloader.flush()
    with pytest.raises(OSError, match="writing .* failed"), packer:
        model(input_ids=ids, labels=ids)
    packer.close()


@needs_libaio
def test_no_file_is_left_after_close_even_without_backward(nvme_root):
    model = build_model("tiny", seed=0)
    packer = ActivationPacker(model, ActivationPolicy(offloaded(POLICIES[4], nvme_root)))
    ids = token_ids(model.config.vocab_size)
    with packer:
        loss = model(input_ids=ids, labels=ids).loss
    packer.offloader.flush()
    assert len(os.listdir(packer.offloader._nvme.folder)) > 5  # the files are there while the graph lives
    packer.close()
    assert os.listdir(nvme_root) == []
    with pytest.raises(RuntimeError, match="after the offloader was closed"):
        loss.backward()


@needs_libaio
def test_no_file_is_left_at_exit_when_close_is_never_called(nvme_root):
    script = textwrap.dedent(f"""
        import torch
        from lazyzero.activations import ActivationPacker, ActivationPolicy
        from lazyzero.activations.config import ActivationsConfig
        from lazyzero.models.build import build_model
        model = build_model("tiny", seed=0)
        config = ActivationsConfig(enabled=True, offload_layers={{0: "nvme"}}, offload_nvme_path={str(nvme_root)!r})
        packer = ActivationPacker(model, ActivationPolicy(config))
        ids = torch.randint(0, 100, (2, 64))
        with packer:
            loss = model(input_ids=ids, labels=ids).loss
        packer.offloader.flush()
        import os
        print(len(os.listdir(packer.offloader._nvme.folder)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) > 0
    assert os.listdir(nvme_root) == []


def test_cpu_tier_without_cuda_keeps_activations_in_place(nvme_root):
    if torch.cuda.is_available():
        pytest.skip("with CUDA the 'cpu' tier moves activations to pinned host memory")
    expected, kept = run_step(POLICIES[4])
    kept.close()
    found, packer = run_step(offloaded(POLICIES[4], nvme_root, tier="cpu"))
    for name, grad in expected.items():
        torch.testing.assert_close(found[name], grad, atol=0, rtol=0)
    assert packer.accounting.total().offloaded == 0
    packer.close()


@pytest.mark.parametrize("update, message", [
    ({"offload_layers": {5: "nvme"}}, r"no decoder layer \[5\]; the model has layers 0 to 1"),
    ({"offload_layers": {1: "nvme"}, "recompute_layers": [1]}, r"layers \[1\] are recomputed too"),
])
def test_offload_of_layers_that_cannot_offload_is_refused(nvme_root, update, message):
    config = POLICIES[4].model_copy(update={"offload_nvme_path": str(nvme_root), **update})
    with pytest.raises(ValueError, match=message):
        ActivationPacker(build_model("tiny", seed=0), ActivationPolicy(config))
    assert os.listdir(nvme_root) == []
