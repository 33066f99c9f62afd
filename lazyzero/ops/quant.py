"""Block-wise int8 / int4 quantization: op schemas, fake kernels and the Python API.

The schemas below are defined once, in namespace `lazyzero`. Their CPU kernels come from C++
(csrc/quant/quant_cpu.cpp, token_blocks_cpu.cpp) and CUDA kernels from csrc/quant/quant_cuda.cu and
token_blocks_cuda.cu, all attached when
`lazyzero.ops.native_build` loads the native libraries on first use. The exact numerics, including zero
and NaN/Inf blocks, int4 nibble order and the stochastic-rounding hash, are specified by
`lazyzero.ops.quant_reference`, which every kernel matches bit for bit.

Call the wrappers (`quantize_blockwise`, `dequantize_blockwise`, `dequantize_sum_int8`,
`quantize_token_blocks`, `restore_token_blocks`): they check
arguments, load the native kernels lazily and, on a CPU-only machine where they cannot be built,
run the reference instead (after one logged warning).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazyzero.ops import quant_reference
from lazyzero.ops.native_build import ensure_native

SUPPORTED_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BLOCK_SIZE = 256

_SCHEMAS = {
    "quantize_int8": (
        "(Tensor x, int block_size, bool stochastic, int seed) -> (Tensor codes, Tensor scales)"
    ),
    "quantize_int8_into": (
        "(Tensor x, int block_size, bool stochastic, int seed, Tensor(a!) codes, Tensor(b!) scales)"
        " -> ()"
    ),
    "quantize_int4": (
        "(Tensor x, int block_size, bool stochastic, int seed) -> (Tensor packed, Tensor scales)"
    ),
    "dequantize_int8": (
        "(Tensor codes, Tensor scales, int block_size, ScalarType out_dtype) -> Tensor"
    ),
    "dequantize_int8_into": "(Tensor codes, Tensor scales, int block_size, Tensor(a!) out) -> ()",
    "dequantize_int4": (
        "(Tensor packed, Tensor scales, int numel, int block_size, ScalarType out_dtype) -> Tensor"
    ),
    "dequantize_sum_int8": "(Tensor codes, Tensor scales, int block_size, float alpha) -> Tensor",
    "dequantize_sum_int8_into": (
        "(Tensor codes, Tensor scales, int block_size, float alpha, Tensor(a!) out) -> ()"
    ),
    "quantize_int8_outliers": (
        "(Tensor x, int block_size, bool stochastic, int seed)"
        " -> (Tensor codes, Tensor scales, Tensor values, Tensor index)"
    ),
    "quantize_int4_outliers": (
        "(Tensor x, int block_size, bool stochastic, int seed)"
        " -> (Tensor packed, Tensor scales, Tensor values, Tensor index)"
    ),
    "restore_block_outliers_": "(Tensor(a!) out, Tensor values, Tensor index, int block_size) -> ()",
    "quantize_token_blocks": (
        "(Tensor x, int tokens, int channels, int bits, int block_size, bool stochastic, int seed)"
        " -> (Tensor codes, Tensor scales, Tensor centres)"
    ),
    "restore_token_blocks": (
        "(Tensor codes, Tensor scales, Tensor centres, int tokens, int channels, int bits, int block_size)"
        " -> Tensor"
    ),
}

for _name, _schema in _SCHEMAS.items():
    torch.library.define(f"lazyzero::{_name}", _schema)


def _num_blocks(numel, block_size: int):
    return (numel + block_size - 1) // block_size


@torch.library.register_fake("lazyzero::quantize_int8")
def _quantize_int8_fake(x, block_size, stochastic, seed):
    n = x.numel()
    return x.new_empty((n,), dtype=torch.int8), x.new_empty(
        (_num_blocks(n, block_size),), dtype=torch.float32
    )


@torch.library.register_fake("lazyzero::quantize_int8_into")
def _quantize_int8_into_fake(x, block_size, stochastic, seed, codes, scales):
    return None


@torch.library.register_fake("lazyzero::quantize_int4")
def _quantize_int4_fake(x, block_size, stochastic, seed):
    n = x.numel()
    return x.new_empty(((n + 1) // 2,), dtype=torch.uint8), x.new_empty(
        (_num_blocks(n, block_size),), dtype=torch.float32
    )


def _outliers_fake(x, block_size):
    nblocks = _num_blocks(x.numel(), block_size)
    return x.new_empty((nblocks,), dtype=torch.float32), x.new_empty((nblocks,), dtype=torch.uint8)


@torch.library.register_fake("lazyzero::quantize_int8_outliers")
def _quantize_int8_outliers_fake(x, block_size, stochastic, seed):
    return (*_quantize_int8_fake(x, block_size, stochastic, seed), *_outliers_fake(x, block_size))


@torch.library.register_fake("lazyzero::quantize_int4_outliers")
def _quantize_int4_outliers_fake(x, block_size, stochastic, seed):
    return (*_quantize_int4_fake(x, block_size, stochastic, seed), *_outliers_fake(x, block_size))


@torch.library.register_fake("lazyzero::restore_block_outliers_")
def _restore_block_outliers_fake(out, values, index, block_size):
    return None


@torch.library.register_fake("lazyzero::dequantize_int8")
def _dequantize_int8_fake(codes, scales, block_size, out_dtype):
    return codes.new_empty((codes.numel(),), dtype=out_dtype)


@torch.library.register_fake("lazyzero::dequantize_int8_into")
def _dequantize_int8_into_fake(codes, scales, block_size, out):
    return None


@torch.library.register_fake("lazyzero::dequantize_int4")
def _dequantize_int4_fake(packed, scales, numel, block_size, out_dtype):
    return packed.new_empty((numel,), dtype=out_dtype)


@torch.library.register_fake("lazyzero::dequantize_sum_int8")
def _dequantize_sum_int8_fake(codes, scales, block_size, alpha):
    return codes.new_empty((codes.shape[1],), dtype=torch.float32)


@torch.library.register_fake("lazyzero::dequantize_sum_int8_into")
def _dequantize_sum_int8_into_fake(codes, scales, block_size, alpha, out):
    return None


def _padded_token_blocks(numel: int, tokens: int, channels: int, block_size: int) -> int:
    """Blocks of a lead x tokens x channels storage cut along tokens (quant_reference: "Blocks along tokens")."""
    return numel // (tokens * channels) * channels * _num_blocks(tokens, block_size)


@torch.library.register_fake("lazyzero::quantize_token_blocks")
def _quantize_token_blocks_fake(x, tokens, channels, bits, block_size, stochastic, seed):
    nblocks = _padded_token_blocks(x.numel(), tokens, channels, block_size)
    padded = nblocks * block_size
    codes = x.new_empty((padded,), dtype=torch.int8) if bits == 8 else x.new_empty((padded // 2,), dtype=torch.uint8)
    return codes, x.new_empty((nblocks,), dtype=torch.float32), x.new_empty((nblocks,))


@torch.library.register_fake("lazyzero::restore_token_blocks")
def _restore_token_blocks_fake(codes, scales, centres, tokens, channels, bits, block_size):
    lead = scales.shape[0] // (channels * _num_blocks(tokens, block_size))
    return centres.new_empty((lead * tokens * channels,))


class NativeCalls:
    """`with NativeCalls() as calls:` counts the native ops called through their wrappers (quant, norms), by
    name (`calls.counts`, `calls.total`), whether the native kernel or the reference runs them. On a
    GPU each is one kernel launch; what a caller launches beyond them is its own tensor operations."""

    _active: list[NativeCalls] = []

    def __init__(self):
        self.counts: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> NativeCalls:
        NativeCalls._active.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        NativeCalls._active.remove(self)


def run_counted(reference, op_name: str, device: torch.device, *args):
    """The native op when its kernels are loaded for `device`, else the function of that name in the
    module `reference` (CPU only); counted by every active `NativeCalls`."""
    for calls in NativeCalls._active:
        calls.counts[op_name] = calls.counts.get(op_name, 0) + 1
    if device.type == "meta" or ensure_native(device.type):
        return getattr(torch.ops.lazyzero, op_name)(*args)
    return getattr(reference, op_name)(*args)


def _run(op_name: str, device: torch.device, *args):
    return run_counted(quant_reference, op_name, device, *args)


@dataclass(frozen=True)
class BlockQuantized:
    """A tensor quantized block-wise by `quantize_blockwise`, with what it takes to restore it."""

    codes: torch.Tensor
    """int8 [n] for bits=8; uint8 [ceil(n/2)] of packed int4 codes for bits=4."""
    scales: torch.Tensor
    """fp32 [ceil(n / block_size)]: absmax / qmax per block (NaN / +Inf for non-finite blocks)."""
    bits: int
    block_size: int
    shape: torch.Size
    """Shape of the original tensor."""
    dtype: torch.dtype
    """dtype of the original tensor, restored by default on dequantization."""
    outlier_values: torch.Tensor | None = None
    """With `keep_outliers`: [nblocks] of the original dtype, each block's largest-magnitude element, kept exact
    (it is one of the tensor's own values, so a bf16 or fp16 tensor's outliers take 2 bytes, not fp32's 4)."""
    outlier_index: torch.Tensor | None = None
    """With `keep_outliers`: uint8 [nblocks], where that element sits in its block."""

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        """Bytes of the stored form: codes, scales and any kept outliers."""
        parts = (self.codes, self.scales, self.outlier_values, self.outlier_index)
        return sum(part.untyped_storage().nbytes() for part in parts if part is not None)


def _check_block_size(bits: int, block_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if bits == 4 and block_size % 2:
        raise ValueError(
            f"block_size must be even for 4-bit codes (two codes share a byte), got {block_size}"
        )


def _check_outlier_block_size(block_size: int) -> None:
    if block_size > quant_reference.MAX_OUTLIER_BLOCK:
        raise ValueError(
            f"block_size must be at most {quant_reference.MAX_OUTLIER_BLOCK} to keep block outliers "
            f"(their index in the block is one byte), got {block_size}"
        )


def _check_float_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{what} must be one of {names}, got {dtype}")


def _check_destination(tensor: torch.Tensor, name: str, dtypes, numel: int, device) -> None:
    if tensor.dtype not in dtypes or tensor.numel() != numel or not tensor.is_contiguous():
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(
            f"{name} must be a contiguous {names} tensor of {numel} elements, got "
            f"{tensor.dtype} {list(tensor.shape)}"
        )
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the input on {device}")


def quantize_blockwise(
    x: torch.Tensor,
    bits: int = 8,
    block_size: int = DEFAULT_BLOCK_SIZE,
    stochastic: bool = False,
    seed: int = 0,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    keep_outliers: bool = False,
) -> BlockQuantized:
    """Quantize `x` (any shape, fp32/bf16/fp16) to symmetric `bits`-bit codes with fp32 scales.

    Blocks are `block_size` consecutive elements of the flattened tensor. Round to nearest (ties to
    even) unless `stochastic`, in which case rounding is unbiased and reproducible: it depends only
    on `seed` and each element's index, identically on every backend. For bits=8, `out` may give
    preallocated (codes int8 [n], scales fp32 [ceil(n / block_size)]) to write into, e.g. a
    persistent communication buffer. `keep_outliers`: each block's largest-magnitude element is kept
    exact and the block is scaled by the rest (block_size <= 256; quant_reference, "Block outliers").
    """
    _check_block_size(bits, block_size)
    _check_float_dtype(x.dtype, "x.dtype")
    if not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must fit in int64, got {seed}")
    if keep_outliers:
        if out is not None:
            raise ValueError("out= cannot be combined with keep_outliers")
        _check_outlier_block_size(block_size)
        op_name = "quantize_int8_outliers" if bits == 8 else "quantize_int4_outliers"
        codes, scales, values, index = _run(op_name, x.device, x, block_size, stochastic, seed)
        return BlockQuantized(codes, scales, bits, block_size, x.shape, x.dtype, values.to(x.dtype), index)
    if out is None:
        op_name = "quantize_int8" if bits == 8 else "quantize_int4"
        codes, scales = _run(op_name, x.device, x, block_size, stochastic, seed)
        return BlockQuantized(codes, scales, bits, block_size, x.shape, x.dtype)
    if bits != 8:
        raise ValueError("out= is supported for bits=8 only")
    codes, scales = out
    _check_destination(codes, "out codes", (torch.int8,), x.numel(), x.device)
    nblocks = _num_blocks(x.numel(), block_size)
    _check_destination(scales, "out scales", (torch.float32,), nblocks, x.device)
    _run("quantize_int8_into", x.device, x, block_size, stochastic, seed, codes, scales)
    return BlockQuantized(codes, scales, bits, block_size, x.shape, x.dtype)


def dequantize_blockwise(
    q: BlockQuantized, dtype: torch.dtype | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Restore a `BlockQuantized` to its shape, in `dtype` (default: its original dtype).

    For bits=8, `out` may give a preallocated contiguous float tensor of q.numel elements to write
    into (its dtype is the output dtype); it is returned as it is, not reshaped.
    """
    _check_block_size(q.bits, q.block_size)
    if out is not None:
        if q.outlier_values is not None:
            raise ValueError("out= is not supported for a tensor quantized with keep_outliers")
        if q.bits != 8:
            raise ValueError("out= is supported for bits=8 only")
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"dtype {dtype} contradicts out.dtype {out.dtype}")
        _check_destination(out, "out", SUPPORTED_DTYPES, q.numel, q.codes.device)
        _run("dequantize_int8_into", q.codes.device, q.codes, q.scales, q.block_size, out)
        return out
    out_dtype = q.dtype if dtype is None else dtype
    _check_float_dtype(out_dtype, "dtype")
    if q.bits == 8:
        flat = _run("dequantize_int8", q.codes.device, q.codes, q.scales, q.block_size, out_dtype)
    else:
        flat = _run(
            "dequantize_int4", q.codes.device, q.codes, q.scales, q.numel, q.block_size, out_dtype
        )
    if q.outlier_values is not None:
        values = q.outlier_values.to(torch.float32)  # the kernels' format; exact from any supported dtype
        _run("restore_block_outliers_", flat.device, flat, values, q.outlier_index, q.block_size)
    return flat.view(q.shape)


def _check_sum_args(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> None:
    _check_block_size(8, block_size)
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"codes must be int8 [K, n], got {codes.dtype} {list(codes.shape)}")
    expected = [codes.shape[0], _num_blocks(codes.shape[1], block_size)]
    if scales.dtype != torch.float32 or list(scales.shape) != expected:
        raise ValueError(
            f"scales must be float32 {expected} for codes {list(codes.shape)} and block_size "
            f"{block_size}, got {scales.dtype} {list(scales.shape)}"
        )
    if scales.device != codes.device:
        raise ValueError(f"codes ({codes.device}) and scales ({scales.device}) differ in device")


def dequantize_sum_int8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    alpha: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """alpha * sum_k dequantize(codes[k], scales[k]) as fp32 [n], accumulated in k order.

    codes: int8 [K, n] (e.g. the K chunks received by an int8 all-to-all); scales: fp32
    [K, ceil(n / block_size)]. Use alpha = 1 / world_size to average. With `out` (fp32, contiguous,
    n elements) the result is written there and `out` is returned.
    """
    _check_sum_args(codes, scales, block_size)
    if out is None:
        return _run("dequantize_sum_int8", codes.device, codes, scales, block_size, float(alpha))
    _check_destination(out, "out", (torch.float32,), codes.shape[1], codes.device)
    _run("dequantize_sum_int8_into", codes.device, codes, scales, block_size, float(alpha), out)
    return out


def _check_token_layout(numel: int, tokens: int, channels: int) -> None:
    if tokens < 1 or channels < 1 or numel % (tokens * channels):
        raise ValueError(f"{numel} elements are not lead x {tokens} tokens x {channels} channels")


def quantize_token_blocks(
    x: torch.Tensor, tokens: int, channels: int, bits: int = 8, block_size: int = DEFAULT_BLOCK_SIZE,
    stochastic: bool = False, seed: int = 0,
) -> tuple[BlockQuantized, torch.Tensor]:
    """Quantize `x`, whose elements in their storage order are lead x tokens x channels, in centred
    blocks of `block_size` tokens within one channel (quant_reference: "Blocks along tokens"), in one
    native call that reads `x` where it lies: (the centred blocks, padded to whole blocks, as a
    `BlockQuantized` of fp32 values; each block's centre in x's dtype). `restore_token_blocks` undoes it.
    x must be contiguous (a flat view of a storage is)."""
    _check_block_size(bits, block_size)
    _check_float_dtype(x.dtype, "x.dtype")
    _check_token_layout(x.numel(), tokens, channels)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous: it is read in its storage order")
    codes, scales, centres = _run("quantize_token_blocks", x.device, x, tokens, channels, bits, block_size,
                                  stochastic, seed)
    padded = torch.Size([scales.numel() * block_size])
    return BlockQuantized(codes, scales, bits, block_size, padded, torch.float32), centres


def restore_token_blocks(q: BlockQuantized, centres: torch.Tensor, tokens: int, channels: int) -> torch.Tensor:
    """The elements `quantize_token_blocks` quantized, flat, in their storage order and centres' dtype."""
    _check_block_size(q.bits, q.block_size)
    _check_float_dtype(centres.dtype, "centres.dtype")
    return _run("restore_token_blocks", q.codes.device, q.codes, q.scales, centres, tokens, channels, q.bits,
                q.block_size)
