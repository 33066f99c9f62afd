"""The quantized collectives on CUDA tensors over NCCL (one rank): the same bits as on the CPU.

Marked `gpu`: skipped without a CUDA device. One rank keeps the check to what a single GPU can
show: the exchange path (packing, native CUDA kernels, error feedback, requantization) runs on the
device and gives exactly the CPU result, since the kernels are bit-exact across backends.
"""

import pytest
import torch
import torch.distributed as dist

from lazyzero.gradients import ChunkLayout, quantized_all_reduce, quantized_reduce_scatter
from lazyzero.ops import native_build
from lazyzero.testing import free_port

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cpu_group():
    """A one-rank NCCL default group for the CUDA side, and a gloo group over the same rank for
    the CPU side of each comparison."""
    assert native_build.ensure_native("cuda") and native_build.ensure_native("cpu")
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.new_group([0], backend="gloo")
    dist.destroy_process_group()


@pytest.mark.parametrize("numel", [1, 255, 4097, 1 << 20])
def test_reduce_scatter_with_error_feedback_matches_the_cpu_bit_for_bit(cpu_group, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    layout = ChunkLayout.per_tensor([numel // 2, numel - numel // 2], 1)
    residuals = {"cpu": torch.full((numel,), 0.125), "cuda": torch.full((numel,), 0.125, device="cuda")}
    outputs = {}
    for device in ("cpu", "cuda"):
        outputs[device] = quantized_reduce_scatter(
            x.to(device), None if device == "cuda" else cpu_group, layout=layout,
            residual=residuals[device], stochastic=True, seed=3).output
    assert outputs["cuda"].is_cuda
    assert torch.equal(outputs["cuda"].cpu(), outputs["cpu"])
    assert torch.equal(residuals["cuda"].cpu(), residuals["cpu"])


def test_all_reduce_matches_the_cpu_bit_for_bit(cpu_group):
    x = torch.randn(100003, generator=torch.Generator().manual_seed(7))
    on_gpu = quantized_all_reduce(x.cuda(), block_size=128).output
    on_cpu = quantized_all_reduce(x, cpu_group, block_size=128).output
    assert torch.equal(on_gpu.cpu(), on_cpu)
