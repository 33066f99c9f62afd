"""RMSNorm over rows: the CUDA kernels against the PyTorch reference (computed on the CPU), and the
number of launches. Marked `gpu`: skipped on machines without a CUDA device."""

import pytest
import torch
from norm_samples import DTYPE_PAIRS, EPS, GRAD_WANTS, SHAPES, assert_norm_close, norm_inputs
from torch.profiler import ProfilerActivity, profile

import lazyzero.ops.norms  # noqa: F401  (defines the torch.ops.lazyzero schemas)
from lazyzero.ops import native_build, norms_reference

pytestmark = pytest.mark.gpu
ops = torch.ops.lazyzero
# More rows than the grid has blocks (8 per SM), so the blocks go round the rows.
MANY_ROWS = ((20000,), 256)


@pytest.fixture(scope="module", autouse=True)
def native_cuda():
    assert native_build.ensure_native("cuda")


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=str)
def test_forward_matches_reference(dtypes):
    for lead, width in [*SHAPES, MANY_ROWS]:
        x, weight, _ = norm_inputs(lead, width, *dtypes)
        found = ops.rms_norm_rows(x.cuda(), weight.cuda(), EPS)
        assert found.is_cuda
        assert_norm_close(found, norms_reference.rms_norm_rows(x, weight, EPS))


@pytest.mark.parametrize("wants", GRAD_WANTS, ids=["both", "x", "weight", "neither"])
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=str)
def test_backward_matches_reference(dtypes, wants):
    for lead, width in [*SHAPES, MANY_ROWS]:
        x, weight, grad_y = norm_inputs(lead, width, *dtypes)
        found = ops.rms_norm_rows_backward(x.cuda(), grad_y.cuda(), weight.cuda(), EPS, *wants)
        expected = norms_reference.rms_norm_rows_backward(x, grad_y, weight, EPS, *wants)
        for got, want in zip(found, expected):
            assert_norm_close(got, want)


def kernel_launches(run) -> int:
    run()  # first call: loads, allocates
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def test_one_launch_forward_two_backward():
    x, weight, grad_y = (t.cuda() for t in norm_inputs((4096,), 2048, torch.bfloat16, torch.bfloat16))
    assert kernel_launches(lambda: ops.rms_norm_rows(x, weight, EPS)) == 1
    assert kernel_launches(lambda: ops.rms_norm_rows_backward(x, grad_y, weight, EPS, True, False)) == 1
    assert kernel_launches(lambda: ops.rms_norm_rows_backward(x, grad_y, weight, EPS, True, True)) == 2
