"""RMSNorm over rows: the C++ CPU kernels against the PyTorch reference, the reference against
transformers' LlamaRMSNorm, and opcheck of both ops."""

import pytest
import torch
from norm_samples import DTYPE_PAIRS, EPS, GRAD_WANTS, SHAPES, assert_norm_close, norm_inputs
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import lazyzero.ops.norms
from lazyzero.ops import norms_reference

pytestmark = pytest.mark.usefixtures("native_cpu")
ops = torch.ops.lazyzero


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=str)
def test_forward_matches_reference(dtypes):
    for lead, width in SHAPES:
        x, weight, _ = norm_inputs(lead, width, *dtypes)
        assert_norm_close(ops.rms_norm_rows(x, weight, EPS), norms_reference.rms_norm_rows(x, weight, EPS))


@pytest.mark.parametrize("wants", GRAD_WANTS, ids=["both", "x", "weight", "neither"])
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=str)
def test_backward_matches_reference(dtypes, wants):
    for lead, width in SHAPES:
        x, weight, grad_y = norm_inputs(lead, width, *dtypes)
        found = ops.rms_norm_rows_backward(x, grad_y, weight, EPS, *wants)
        expected = norms_reference.rms_norm_rows_backward(x, grad_y, weight, EPS, *wants)
        for got, want in zip(found, expected):
            assert_norm_close(got, want)


def test_weight_gradient_does_not_depend_on_the_thread_count():
    x, weight, grad_y = norm_inputs((5000,), 96, torch.bfloat16, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.rms_norm_rows_backward(x, grad_y, weight, EPS, True, True)
    finally:
        torch.set_num_threads(threads)
    shared = ops.rms_norm_rows_backward(x, grad_y, weight, EPS, True, True)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_is_transformers_rms_norm(dtype):
    norm = LlamaRMSNorm(77, eps=EPS).to(dtype)
    x, weight, _ = norm_inputs((6, 5), 77, dtype, dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(norms_reference.rms_norm_rows(x, weight, EPS), norm(x))


def test_empty_rows_give_empty_outputs_and_a_zero_weight_gradient():
    x, weight, grad_y = norm_inputs((0,), 16, torch.float32, torch.float32)
    assert ops.rms_norm_rows(x, weight, EPS).shape == (0, 16)
    grad_x, grad_weight = ops.rms_norm_rows_backward(x, grad_y, weight, EPS, True, True)
    assert grad_x.shape == (0, 16) and torch.equal(grad_weight, torch.zeros(16))


def test_a_gradient_of_another_dtype_is_refused():
    x, weight, grad_y = norm_inputs((4,), 16, torch.bfloat16, torch.bfloat16)
    with pytest.raises(RuntimeError, match="grad_y must be"):
        ops.rms_norm_rows_backward(x, grad_y.float(), weight, EPS, True, True)


def test_opcheck_every_op():
    x, weight, grad_y = norm_inputs((3, 5), 40, torch.bfloat16, torch.bfloat16)
    samples = [
        ("rms_norm_rows", (x, weight, EPS)),
        ("rms_norm_rows", (x.float(), weight, EPS)),
        ("rms_norm_rows_backward", (x, grad_y, weight, EPS, True, True)),
        ("rms_norm_rows_backward", (x, grad_y, weight, EPS, False, True)),
        ("rms_norm_rows_backward", (x, grad_y, weight, EPS, True, False)),
    ]
    assert {name for name, _ in samples} == set(lazyzero.ops.norms._SCHEMAS)
    for op_name, args in samples:
        torch.library.opcheck(getattr(ops, op_name).default, args)
