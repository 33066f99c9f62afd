"""Pure-PyTorch reference of the block-wise quantization ops: the specification the kernels match.

Every function here has exactly the signature of the `torch.ops.lazyzero` op of the same name, so
the Python wrappers in `lazyzero.ops.quant` can call either. The C++ (csrc/quant/quant_cpu.cpp) and
CUDA (csrc/quant/quant_cuda.cu) kernels perform the same fp32 operations in the same order and
therefore agree with these functions bit for bit (codes and scales; NaN payloads aside).

Layout shared by all ops
------------------------
* The input is flattened to `n` elements and cut into `ceil(n / block_size)` blocks of
  `block_size` consecutive elements; the last block may be shorter.
* Per block, in fp32: `absmax = max |x|`, `scale = absmax / qmax` (true division),
  with qmax = 127 for int8 and 7 for int4.
* Round to nearest: `code = clamp(round_half_even(x / scale), -qmax, qmax)`.
* Stochastic rounding: `code = clamp(floor(x / scale + u), -qmax, qmax)` where
  `u = uniform(seed, i)` in [0, 1) depends only on the seed and the global element index `i`
  (see `uniform_from_counter`), so every backend draws the same `u`.
* Zero blocks: when `scale == 0` (all zeros, or absmax so small that absmax / qmax underflows) all
  codes are 0 and the block dequantizes to exactly 0.
* Non-finite blocks: a block holding any NaN gets scale NaN; a block holding +-Inf and no NaN gets
  scale +Inf. Codes in such a block are `+-qmax` for `+-Inf` elements and 0 elsewhere, so on
  dequantization (`code * scale`) every element of the block is NaN or +-Inf: quantization never
  turns a non-finite input into a finite number, and +-Inf keeps its sign in an Inf-only block.
* Block outliers (the `*_outliers` ops): in each block the element of largest magnitude (largest
  `abs_bits`, so NaN above Inf above any finite value; the first such element on ties) is taken out:
  its value (in fp32) and its index inside the block (uint8, so `block_size <= 256`) are returned,
  and the block is quantized as above with that element replaced by 0, which gets code 0. Restoring
  writes the value back over the dequantized element. So one outlier per block costs no precision
  to the other elements, whose scale comes from the next largest magnitude.
* int4 packing: element 2j goes to the low nibble of byte j, element 2j+1 to the high nibble, each
  as a 4-bit two's-complement number; an odd element count leaves the last high nibble 0.
  `block_size` must be even so that no byte straddles two blocks.
* Blocks along tokens (`quantize_token_blocks`, `restore_token_blocks`): the input is a storage of
  `lead x tokens x channels` elements in that order. Block `(l * channels + c) * token_blocks + j`
  holds the elements `(l, t, c)` for `t` in `j * block_size .. (j + 1) * block_size - 1`, `t` clamped
  to `tokens - 1` (the last token repeated to fill the last block); `token_blocks =
  ceil(tokens / block_size)`. Per block, in fp32: `centre = (min + max) / 2` (NaN when the block holds
  a NaN) is stored in the input's dtype, the block minus that stored centre is quantized as above
  (its global element indices those of this padded layout), and restoring computes
  `code * scale + centre` in fp32 and rounds once to the input's dtype, in the storage's own order.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_MAX = 7

# splitmix64 constants (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number generators").
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX_MULTIPLIER_1 = 0xBF58476D1CE4E5B9
_MIX_MULTIPLIER_2 = 0x94D049BB133111EB
_UINT64_MASK = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """The int64 whose two's-complement bits equal the low 64 bits of `value`."""
    value &= _UINT64_MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    """uint64 `z >> bits` on int64 storage (torch's `>>` on int64 is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 tensors holding uint64 bits (int64 products wrap mod 2**64)."""
    z = (z ^ _shift_right_logical(z, 30)) * _as_int64(_MIX_MULTIPLIER_1)
    z = (z ^ _shift_right_logical(z, 27)) * _as_int64(_MIX_MULTIPLIER_2)
    return z ^ _shift_right_logical(z, 31)


def stream_key(seed: int) -> int:
    """The 64-bit key of a seed: mix64(seed as uint64), so nearby seeds give unrelated streams."""
    return int(_mix64(torch.tensor([_as_int64(seed)], dtype=torch.int64)).item())


def uniform_from_counter(
    seed: int, start: int, count: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """fp32 uniforms in [0, 1) for global element indices start .. start+count-1.

    u(i) = (mix64(stream_key(seed) + i * golden_gamma) >> 40) * 2**-24 with uint64 wrap-around:
    24 random bits, exactly representable in fp32, a pure function of (seed, i).
    """
    index = torch.arange(start, start + count, dtype=torch.int64, device=device)
    hashed = _mix64(stream_key(seed) + index * _as_int64(_GOLDEN_GAMMA))
    return _shift_right_logical(hashed, 40).to(torch.float32) * 2.0**-24


def _blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """x flattened to fp32 and zero-padded to whole blocks, shape [nblocks, block_size]; and n."""
    flat = x.reshape(-1).to(torch.float32)
    n = flat.numel()
    nblocks = -(-n // block_size)
    padded = torch.nn.functional.pad(flat, (0, nblocks * block_size - n))
    return padded.view(nblocks, block_size), n


def _quantize_codes(
    x: torch.Tensor, block_size: int, qmax: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes in [-qmax, qmax] (length n) and fp32 scales, following the module docstring."""
    blocks, n = _blocks(x, block_size)
    qmax_f = torch.full((), float(qmax), dtype=torch.float32, device=blocks.device)
    # amax propagates NaN and Inf, which yields the NaN / +Inf scales of non-finite blocks.
    scales = blocks.abs().amax(dim=1) / qmax_f
    scaled = blocks / scales[:, None]
    if stochastic:
        uniforms = uniform_from_counter(seed, 0, blocks.numel(), blocks.device)
        uniforms = uniforms.view_as(blocks)
        rounded = torch.floor(scaled + uniforms)
    else:
        rounded = torch.round(scaled)
    codes = rounded.clamp(-qmax, qmax)
    codes = torch.where((scales == 0)[:, None], 0.0, codes)
    nonfinite_block = ~torch.isfinite(scales)[:, None]
    inf_codes = torch.where(torch.isinf(blocks), torch.sign(blocks) * qmax, 0.0)
    codes = torch.where(nonfinite_block, inf_codes, codes)
    return codes.reshape(-1)[:n].to(torch.int8), scales


def quantize_int8(
    x: torch.Tensor, block_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric int8: codes int8 [n] in [-127, 127], scales fp32 [ceil(n/block_size)].

    x: any shape, fp32 / bf16 / fp16 (converted to fp32 first). seed is used only when stochastic.
    """
    return _quantize_codes(x, block_size, INT8_MAX, stochastic, seed)


def quantize_int8_into(
    x: torch.Tensor,
    block_size: int,
    stochastic: bool,
    seed: int,
    codes: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """quantize_int8 written into existing int8 `codes` [n] and fp32 `scales` tensors."""
    new_codes, new_scales = quantize_int8(x, block_size, stochastic, seed)
    codes.copy_(new_codes)
    scales.copy_(new_scales)


def quantize_int4(
    x: torch.Tensor, block_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric int4: packed uint8 [ceil(n/2)] of codes in [-7, 7], fp32 scales.

    block_size must be even (one byte never holds two blocks). Nibble order: module docstring.
    """
    codes, scales = _quantize_codes(x, block_size, INT4_MAX, stochastic, seed)
    return _pack_int4(codes), scales


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-8, 7] -> uint8 bytes, element 2j in the low nibble of byte j."""
    padded = torch.nn.functional.pad(codes.to(torch.int32), (0, codes.numel() % 2))
    pairs = padded.view(-1, 2) & 0xF
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def _unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """uint8 bytes -> int32 codes (length numel); `(nibble ^ 8) - 8` sign-extends 4 bits."""
    as_int = packed.to(torch.int32)
    low = ((as_int & 0xF) ^ 8) - 8
    high = ((as_int >> 4) ^ 8) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel]


def _expand_scales(scales: torch.Tensor, block_size: int, numel: int) -> torch.Tensor:
    """Per-element scale: scales[i // block_size] for i < numel."""
    return scales.repeat_interleave(block_size)[:numel]


def dequantize_int8(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """out[i] = fp32(codes[i]) * scales[i // block_size], then cast to out_dtype; shape [n]."""
    values = codes.reshape(-1).to(torch.float32) * _expand_scales(scales, block_size, codes.numel())
    return values.to(out_dtype)


def dequantize_int8_into(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor
) -> None:
    """dequantize_int8 written into an existing float tensor `out` [n], in out's dtype."""
    out.copy_(dequantize_int8(codes, scales, block_size, out.dtype))


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, block_size: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of quantize_int4 for the first `numel` elements; shape [numel], dtype out_dtype."""
    codes = _unpack_int4(packed.reshape(-1), numel)
    values = codes.to(torch.float32) * _expand_scales(scales, block_size, numel)
    return values.to(out_dtype)


def dequantize_sum_int8(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, alpha: float
) -> torch.Tensor:
    """alpha * sum_k codes[k] * scales[k] over K quantized chunks; fp32 [n].

    codes: int8 [K, n]; scales: fp32 [K, ceil(n / block_size)]. Accumulates in fp32 starting from
    0 in k order, each product rounded before the add (no fused multiply-add), and multiplies by
    fp32(alpha) at the end. This is the local reduction after an int8 all-to-all of gradients
    (alpha = 1 / world_size averages).
    """
    n = codes.shape[1]
    acc = torch.zeros(n, dtype=torch.float32, device=codes.device)
    for k in range(codes.shape[0]):
        acc = acc + codes[k].to(torch.float32) * _expand_scales(scales[k], block_size, n)
    return acc * torch.full((), alpha, dtype=torch.float32, device=codes.device)


def dequantize_sum_int8_into(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, alpha: float, out: torch.Tensor
) -> None:
    """dequantize_sum_int8 written into an existing fp32 tensor `out` of n elements."""
    out.view(-1).copy_(dequantize_sum_int8(codes, scales, block_size, alpha))


MAX_OUTLIER_BLOCK = 256  # the index of an outlier inside its block is one byte


def _take_block_outliers(
    x: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x flat in fp32 with each block's largest-magnitude element zeroed, those values fp32
    [nblocks], their indices in their blocks uint8 [nblocks]); see the module docstring."""
    blocks, n = _blocks(x, block_size)
    abs_bits = blocks.view(torch.int32) & 0x7FFFFFFF  # padding is +0: bits 0, never above a real element
    index = abs_bits.argmax(dim=1, keepdim=True)  # the first maximal element
    values = blocks.gather(1, index).squeeze(1)
    remainder = blocks.scatter(1, index, 0.0).reshape(-1)[:n]
    return remainder, values, index.squeeze(1).to(torch.uint8)


def quantize_int8_outliers(
    x: torch.Tensor, block_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int8 of x with each block's outlier taken out: (codes, scales, values, index)."""
    remainder, values, index = _take_block_outliers(x, block_size)
    codes, scales = quantize_int8(remainder, block_size, stochastic, seed)
    return codes, scales, values, index


def quantize_int4_outliers(
    x: torch.Tensor, block_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int4 of x with each block's outlier taken out: (packed, scales, values, index)."""
    remainder, values, index = _take_block_outliers(x, block_size)
    packed, scales = quantize_int4(remainder, block_size, stochastic, seed)
    return packed, scales, values, index


def restore_block_outliers_(
    out: torch.Tensor, values: torch.Tensor, index: torch.Tensor, block_size: int
) -> None:
    """Write each block's outlier back: out[b * block_size + index[b]] = values[b] (in out's dtype)."""
    starts = torch.arange(values.numel(), dtype=torch.int64, device=out.device) * block_size
    out.view(-1)[starts + index.to(torch.int64)] = values.to(out.dtype)


def _token_block_index(tokens: int, block_size: int, device) -> torch.Tensor:
    """The token each position of a channel's padded blocks reads: 0 .. tokens-1, then the last again."""
    padded = -(-tokens // block_size) * block_size
    return torch.arange(padded, device=device).clamp_(max=max(tokens - 1, 0))


def _token_blocks(x: torch.Tensor, tokens: int, channels: int, block_size: int) -> torch.Tensor:
    """x (lead x tokens x channels elements) as fp32 blocks along tokens, [lead * channels * token_blocks,
    block_size], in the module docstring's order."""
    flat = x.reshape(-1).to(torch.float32)
    by_channel = flat.view(-1, tokens, channels).transpose(1, 2)  # [lead, channels, tokens]
    return by_channel[:, :, _token_block_index(tokens, block_size, x.device)].reshape(-1, block_size)


def quantize_token_blocks(
    x: torch.Tensor, tokens: int, channels: int, bits: int, block_size: int, stochastic: bool, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centred blocks along tokens (module docstring): (codes int8 [padded] or packed uint8
    [padded / 2], scales fp32 [nblocks], centres [nblocks] in x's dtype), padded = nblocks * block_size.

    x: lead x tokens x channels elements, fp32 / bf16 / fp16, read flat in its own order.
    """
    blocks = _token_blocks(x, tokens, channels, block_size)
    low, high = torch.aminmax(blocks, dim=1)  # NaN in a block gives NaN for both
    centres = ((low + high) / 2).to(x.dtype)
    centred = blocks - centres.to(torch.float32)[:, None]
    qmax = INT8_MAX if bits == 8 else INT4_MAX
    codes, scales = _quantize_codes(centred, block_size, qmax, stochastic, seed)
    return (codes if bits == 8 else _pack_int4(codes)), scales, centres


def restore_token_blocks(
    codes: torch.Tensor, scales: torch.Tensor, centres: torch.Tensor, tokens: int, channels: int, bits: int,
    block_size: int
) -> torch.Tensor:
    """Inverse of quantize_token_blocks: the storage's elements, flat, in centres' dtype."""
    padded = scales.numel() * block_size
    as_int = codes.reshape(-1).to(torch.int32) if bits == 8 else _unpack_int4(codes.reshape(-1), padded)
    values = as_int.to(torch.float32) * _expand_scales(scales, block_size, padded)
    return centred_to_storage(values, centres, tokens, channels, block_size)


def centred_to_storage(
    values: torch.Tensor, centres: torch.Tensor, tokens: int, channels: int, block_size: int
) -> torch.Tensor:
    """The second half of restore_token_blocks: fp32 centred values of the padded blocks plus their
    centres, rounded once to centres' dtype and put back in the storage's order, flat."""
    blocks = values.view(-1, block_size) + centres.to(torch.float32)[:, None]
    token_blocks = -(-tokens // block_size)
    by_channel = blocks.view(-1, channels, token_blocks * block_size)[:, :, :tokens]
    return by_channel.transpose(1, 2).reshape(-1).to(centres.dtype)
