"""What an RMSNorm rewritten to save only its input (lazyzero/activations/rewrites.py) asks of the
native ops: its backward and the rebuild of its output are one native call each (`NativeCalls`, one
kernel launch on a GPU, two for a backward with the weight's gradient), whatever the number of rows,
where the old path ran about ten tensor operations per piece of rows."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lazyzero.activations import ActivationPacker, ActivationPolicy, rewrites
from lazyzero.activations.config import ActivationsConfig
from lazyzero.models.build import build_model
from lazyzero.ops import native_build
from lazyzero.ops.quant import NativeCalls

WIDTH = 64
ROWS = (64, 6400)  # with pieces of 16 rows, 4 and 400 pieces on the old path


class TensorOps(TorchDispatchMode):
    """Counts the aten operations run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def small_pieces(native_cpu, monkeypatch):
    monkeypatch.setattr(rewrites, "CPU_PIECE_ELEMENTS", 16 * WIDTH)


@pytest.fixture(scope="module")
def native_cpu():
    if not native_build.ensure_native("cpu"):
        pytest.skip("native CPU kernels unavailable")


class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm(WIDTH)

    def forward(self, x):
        return self.norm(x)


def backward_calls(rows: int) -> tuple[dict, int]:
    model = Holder()
    packer = ActivationPacker(model, ActivationPolicy(ActivationsConfig()))
    x = torch.randn(rows, WIDTH, requires_grad=True)
    with packer:
        out = model(x * 1.0)
    grad = torch.randn(out.shape)
    with NativeCalls() as calls, TensorOps() as tensor_ops:
        out.backward(grad)
    packer.remove()
    return calls.counts, tensor_ops.count


def rebuild_calls(rows: int) -> tuple[dict, int]:
    norm = LlamaRMSNorm(WIDTH)
    x = torch.randn(rows, WIDTH)
    rebuild = rewrites.rebuild_output(norm, norm.forward)
    with torch.no_grad(), NativeCalls() as calls, TensorOps() as tensor_ops:
        output = rebuild(x)
    torch.testing.assert_close(output, norm(x).detach())
    return calls.counts, tensor_ops.count


@pytest.mark.parametrize("measure", [backward_calls, rebuild_calls], ids=["backward", "rebuild"])
def test_one_native_call_and_no_operations_per_piece(small_pieces, measure):
    (few_calls, few_ops), (many_calls, many_ops) = (measure(rows) for rows in ROWS)
    expected = "rms_norm_rows_backward" if measure is backward_calls else "rms_norm_rows"
    assert few_calls[expected] == many_calls[expected] == 1
    assert few_calls == many_calls and few_ops == many_ops


def test_a_llama_calls_the_backward_once_per_norm_and_rebuilds_norm_outputs(native_cpu):
    model = build_model("tiny", "llama", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    packer = ActivationPacker(model, ActivationPolicy(ActivationsConfig()))
    with NativeCalls() as calls:
        with packer:
            loss = model(ids).logits.float().pow(2).mean()
        loss.backward()
    packer.remove()
    rms_norms = [module for module in model.modules() if isinstance(module, LlamaRMSNorm)]
    rewritten = calls.counts.get("rms_norm_rows_backward", 0)
    assert 0 < rewritten <= len(rms_norms)
    assert 0 < calls.counts.get("rms_norm_rows", 0) <= rewritten
