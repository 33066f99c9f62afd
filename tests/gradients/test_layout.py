"""Chunk layouts, error bounds and argument checks of the quantized collectives, in one process
(the collectives themselves run on a one-rank gloo group here; tests/comm/
test_quantized_collectives.py runs them on 2 and 4 real ranks)."""

import pytest
import torch
import torch.distributed as dist

from lazyzero.gradients import (
    ChunkLayout,
    ExchangeBuffers,
    any_nonfinite,
    deepspeed_chunk_length,
    quantized_all_reduce,
    quantized_reduce_scatter,
    reduce_scatter_error_bound,
)
from lazyzero.gradients.error_bound import NEAREST_STEP
from lazyzero.ops import dequantize_blockwise, quantize_blockwise
from lazyzero.testing import free_port


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [0, 1, 2, 5, 255, 257, 4097, 100003])
def test_even_layout_is_deepspeeds_slicing(numel, world):
    """DeepSpeed's reduce_scatter_coalesced gives rank r flat[r * chunk : r * chunk + chunk]."""
    chunk = -(-numel // world)
    flat = torch.arange(numel)
    layout = ChunkLayout.even(numel, world)
    for rank in range(world):
        expected = flat[rank * chunk : rank * chunk + chunk]
        ((offset, length),) = layout.pieces[rank]
        assert length == expected.numel() == deepspeed_chunk_length(numel, world, rank)
        assert torch.equal(flat[offset : offset + length], expected)


def test_per_tensor_layout_chunks_each_tensor_on_its_own():
    sizes = [1, 7, 0, 300]
    layout = ChunkLayout.per_tensor(sizes, 4)
    assert layout.numel == 308
    assert [length for _, length in layout.pieces[0]] == [1, 2, 0, 75]
    assert [length for _, length in layout.pieces[3]] == [0, 1, 0, 75]
    assert layout.pieces[1] == ((1, 0), (3, 2), (8, 0), (83, 75))


@pytest.mark.parametrize(
    "ranges, message",
    [
        ([(0, 0, 5), (1, 4, 6)], "exactly once"),  # overlap
        ([(0, 0, 4), (1, 5, 5)], "exactly once"),  # gap
        ([(0, 0, 5), (1, 5, 4)], "cover 9 elements"),  # short
        ([(2, 0, 10)], "not a rank"),
    ],
)
def test_ranges_must_cover_the_bucket_exactly_once(ranges, message):
    with pytest.raises(ValueError, match=message):
        ChunkLayout.from_ranges(10, 2, ranges)


def test_pack_and_unpack_are_inverse_and_pad_with_zeros():
    layout = ChunkLayout.from_ranges(10, 2, [(1, 0, 3), (0, 3, 2), (1, 5, 5)])
    flat = torch.arange(1.0, 11.0)
    rows = torch.full((2, layout.row_length(4)), float("nan"))
    layout.pack(flat, rows, addend=torch.ones(10))
    assert rows.tolist() == [[5, 6, 0, 0, 0, 0, 0, 0], [2, 3, 4, 7, 8, 9, 10, 11]]
    restored = torch.zeros(10)
    layout.unpack(rows, restored)
    assert torch.equal(restored, flat + 1)
    pieces = layout.split(1, rows[1, :8])
    assert [piece.tolist() for piece in pieces] == [[2, 3, 4], [7, 8, 9, 10, 11]]


def test_dense_only_when_rows_need_no_padding():
    assert ChunkLayout.even(4 * 256, 4).is_dense(256)
    assert not ChunkLayout.even(4 * 256 - 1, 4).is_dense(256)
    assert not ChunkLayout.even(4 * 200, 4).is_dense(256)


def test_bound_is_half_a_step_per_rank_and_zero_for_zero_blocks():
    scales = torch.tensor([[1.0, 0.0, float("nan")], [3.0, 0.0, 1.0]])
    bound = reduce_scatter_error_bound(scales, 2, 5, alpha=0.5, stochastic=False)
    per_term = NEAREST_STEP + 4 * 2.0**-17
    assert bound[:2].tolist() == [0.5 * 4.0 * per_term] * 2
    assert bound[2:4].tolist() == [0.0, 0.0]
    assert bound[4].isnan()
    stochastic = reduce_scatter_error_bound(scales, 2, 5, alpha=0.5, stochastic=True)
    assert stochastic[0] > 1.9 * bound[0]


@pytest.fixture
def one_rank_group():
    """A real one-rank gloo process group, torn down afterwards."""
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("numel", [0, 1, 300, 4096])
def test_one_rank_reduce_scatter_is_the_quantization_round_trip(one_rank_group, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    result = quantized_reduce_scatter(x, block_size=64)
    expected = dequantize_blockwise(quantize_blockwise(x, block_size=64), torch.float32)
    assert torch.equal(result.output, expected)
    assert result.wire_bytes == result.fp32_wire_bytes == 0
    assert bool((result.output.double() - x.double()).abs().le(result.error_bound()).all())
    assert not any_nonfinite(result.output)


def test_one_rank_error_feedback_stores_what_was_rounded_away(one_rank_group):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    residual = torch.full((1000,), 0.25)
    buffers = ExchangeBuffers()
    result = quantized_reduce_scatter(x, residual=residual, buffers=buffers)
    # Exact in fp32: x + 0.25 and the residual are both computed from the same rounded values.
    assert torch.equal(result.output + residual, x + 0.25)
    again = quantized_reduce_scatter(x, residual=residual, buffers=buffers)
    assert not torch.equal(again.output, result.output)


def test_one_rank_all_reduce_requantizes_the_reduced_chunk(one_rank_group):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    result = quantized_all_reduce(x, block_size=128)
    once = dequantize_blockwise(quantize_blockwise(x, block_size=128), torch.float32)
    twice = dequantize_blockwise(quantize_blockwise(once, block_size=128), torch.float32)
    assert torch.equal(result.output, twice)
    assert bool((result.output.double() - x.double()).abs().le(result.owned_error_bound()).all())


def test_nan_in_the_input_stays_nan_and_the_residual_is_cleared(one_rank_group):
    x = torch.ones(600)
    x[300] = float("nan")
    residual = torch.zeros(600)
    result = quantized_reduce_scatter(x, residual=residual, block_size=256)
    assert result.output[256:512].isnan().all() and result.output[:256].eq(1).all()
    assert bool(torch.isfinite(residual).all())
    assert any_nonfinite(result.output)


def test_arguments_are_checked(one_rank_group):
    with pytest.raises(ValueError, match="1-D"):
        quantized_reduce_scatter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="residual must be float32"):
        quantized_reduce_scatter(torch.zeros(4), residual=torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="layout is for 5"):
        quantized_reduce_scatter(torch.zeros(4), layout=ChunkLayout.even(5, 1))
    with pytest.raises(ValueError, match="block_size"):
        quantized_reduce_scatter(torch.zeros(4), block_size=0)
