// Host-side argument checks and output allocation of the quant ops, shared by the CPU and CUDA
// kernels so both reject the same inputs with the same message and return the same shapes.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <lazyzero/checks.h>

#include <tuple>

namespace lazyzero::quant {

inline int64_t num_blocks(int64_t numel, int64_t block_size) {
  return (numel + block_size - 1) / block_size;
}

inline void check_block_size(int64_t block_size, bool packs_int4) {
  TORCH_CHECK(block_size > 0, "block_size must be positive, got ", block_size);
  TORCH_CHECK(!packs_int4 || block_size % 2 == 0,
              "int4 block_size must be even so that no byte holds two blocks, got ", block_size);
}

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf;
}

inline void check_float_dtype(at::ScalarType dtype, const char* name) {
  TORCH_CHECK(is_supported_float(dtype), name, " must be float32, bfloat16 or float16, got ",
              dtype);
}

// codes int8 [n] (or packed uint8 [ceil(n/2)]) and fp32 scales [ceil(n/block_size)], on x's device.
inline std::tuple<at::Tensor, at::Tensor> allocate_quantize_outputs(const at::Tensor& x,
                                                                    int64_t block_size,
                                                                    bool packs_int4) {
  check_block_size(block_size, packs_int4);
  check_float_dtype(x.scalar_type(), "x");
  const int64_t n = x.numel();
  const int64_t code_bytes = packs_int4 ? (n + 1) / 2 : n;
  at::Tensor codes = at::empty({code_bytes}, x.options().dtype(packs_int4 ? at::kByte : at::kChar));
  at::Tensor scales = at::empty({num_blocks(n, block_size)}, x.options().dtype(at::kFloat));
  return {codes, scales};
}

// Caller-provided outputs of quantize_int8_into: codes int8 [n], scales fp32 [ceil(n/block_size)].
inline void check_quantize_destinations(const at::Tensor& x, int64_t block_size,
                                        const at::Tensor& codes, const at::Tensor& scales) {
  check_block_size(block_size, false);
  check_float_dtype(x.scalar_type(), "x");
  check_dtype(codes, at::kChar, "codes");
  check_numel(codes, x.numel(), "codes");
  check_dtype(scales, at::kFloat, "scales");
  check_numel(scales, num_blocks(x.numel(), block_size), "scales");
  check_contiguous(codes, "codes");
  check_contiguous(scales, "scales");
  check_same_device(x, codes, "x", "codes");
  check_same_device(x, scales, "x", "scales");
}

inline void check_scales(const at::Tensor& scales, const at::Tensor& codes,
                         int64_t expected_numel) {
  check_dtype(scales, at::kFloat, "scales");
  check_numel(scales, expected_numel, "scales");
  check_same_device(codes, scales, "codes", "scales");
}

inline void check_dequantize_int8_args(const at::Tensor& codes, const at::Tensor& scales,
                                       int64_t block_size, at::ScalarType out_dtype) {
  check_block_size(block_size, false);
  check_dtype(codes, at::kChar, "codes");
  check_scales(scales, codes, num_blocks(codes.numel(), block_size));
  check_float_dtype(out_dtype, "out_dtype");
}

inline void check_dequantize_int4_args(const at::Tensor& packed, const at::Tensor& scales,
                                       int64_t numel, int64_t block_size,
                                       at::ScalarType out_dtype) {
  check_block_size(block_size, true);
  TORCH_CHECK(numel >= 0, "numel must be non-negative, got ", numel);
  check_dtype(packed, at::kByte, "packed");
  check_numel(packed, (numel + 1) / 2, "packed");
  check_scales(scales, packed, num_blocks(numel, block_size));
  check_float_dtype(out_dtype, "out_dtype");
}

// codes int8 [K, n], scales fp32 [K, ceil(n/block_size)].
inline void check_dequantize_sum_args(const at::Tensor& codes, const at::Tensor& scales,
                                      int64_t block_size) {
  check_block_size(block_size, false);
  check_dtype(codes, at::kChar, "codes");
  check_dim(codes, 2, "codes");
  check_dim(scales, 2, "scales");
  check_dtype(scales, at::kFloat, "scales");
  check_same_device(codes, scales, "codes", "scales");
  const int64_t blocks_per_row = num_blocks(codes.size(1), block_size);
  TORCH_CHECK(scales.size(0) == codes.size(0) && scales.size(1) == blocks_per_row,
              "scales must have shape [", codes.size(0), ", ", blocks_per_row, "], got ",
              scales.sizes());
}

inline void check_dequantize_destination(const at::Tensor& out, const at::Tensor& codes) {
  check_float_dtype(out.scalar_type(), "out");
  check_numel(out, codes.numel(), "out");
  check_contiguous(out, "out");
  check_same_device(codes, out, "codes", "out");
}

inline void check_sum_destination(const at::Tensor& out, const at::Tensor& codes) {
  check_dtype(out, at::kFloat, "out");
  check_numel(out, codes.size(1), "out");
  check_contiguous(out, "out");
  check_same_device(codes, out, "codes", "out");
}

// Block outliers (quant_reference: "Block outliers"): an outlier's index in its block is one byte.
constexpr int64_t kMaxOutlierBlock = 256;

inline void check_outlier_block_size(int64_t block_size) {
  TORCH_CHECK(block_size <= kMaxOutlierBlock, "block_size must be at most ", kMaxOutlierBlock,
              " to keep block outliers (their index in the block is one byte), got ", block_size);
}

// Each block's outlier: values fp32 [nblocks] and their indices in the blocks uint8 [nblocks].
inline std::tuple<at::Tensor, at::Tensor> allocate_outlier_outputs(const at::Tensor& x,
                                                                   int64_t block_size) {
  const int64_t nblocks = num_blocks(x.numel(), block_size);
  return {at::empty({nblocks}, x.options().dtype(at::kFloat)),
          at::empty({nblocks}, x.options().dtype(at::kByte))};
}

inline void check_restore_outliers_args(const at::Tensor& out, const at::Tensor& values,
                                        const at::Tensor& index, int64_t block_size) {
  check_block_size(block_size, false);
  check_outlier_block_size(block_size);
  check_float_dtype(out.scalar_type(), "out");
  check_contiguous(out, "out");
  check_dtype(values, at::kFloat, "values");
  check_dtype(index, at::kByte, "index");
  check_numel(values, num_blocks(out.numel(), block_size), "values");
  check_numel(index, values.numel(), "index");
  check_same_device(out, values, "out", "values");
  check_same_device(out, index, "out", "index");
}

// Blocks along tokens (quant_reference: "Blocks along tokens"): a storage of lead x tokens x
// channels elements, cut into blocks of block_size tokens within one channel, the last token repeated
// to fill the last block of each channel. Block (l * channels + c) * token_blocks + j.
struct TokenBlocks {
  int64_t lead;
  int64_t tokens;
  int64_t channels;
  int64_t token_blocks;  // per channel: ceil(tokens / block_size)
  int64_t block_size;

  int64_t count() const { return lead * channels * token_blocks; }
  int64_t padded_numel() const { return count() * block_size; }
};

// Whether `bits` asks for packed int4 codes (else int8); rejects any other width.
inline bool packs_int4_for(int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  return bits == 4;
}

inline TokenBlocks token_blocks_of(int64_t numel, int64_t tokens, int64_t channels,
                                   int64_t block_size) {
  TORCH_CHECK(tokens > 0 && channels > 0 && numel % (tokens * channels) == 0, numel,
              " elements are not lead x ", tokens, " tokens x ", channels, " channels");
  return {numel / (tokens * channels), tokens, channels, num_blocks(tokens, block_size),
          block_size};
}

// codes int8 [padded] (or packed uint8 [padded / 2]), scales fp32 [blocks], centres [blocks] in x's
// dtype, on x's device.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> allocate_token_block_outputs(
    const at::Tensor& x, const TokenBlocks& blocks, bool packs_int4) {
  const int64_t padded = blocks.padded_numel();
  at::Tensor codes = packs_int4 ? at::empty({padded / 2}, x.options().dtype(at::kByte))
                                : at::empty({padded}, x.options().dtype(at::kChar));
  return {codes, at::empty({blocks.count()}, x.options().dtype(at::kFloat)),
          at::empty({blocks.count()}, x.options())};
}

inline TokenBlocks check_quantize_token_blocks_args(const at::Tensor& x, int64_t tokens,
                                                    int64_t channels, int64_t bits,
                                                    int64_t block_size) {
  check_block_size(block_size, packs_int4_for(bits));
  check_float_dtype(x.scalar_type(), "x");
  return token_blocks_of(x.numel(), tokens, channels, block_size);
}

// The blocks that `codes`, `scales` and `centres` hold, checked against one another.
inline TokenBlocks check_restore_token_blocks_args(const at::Tensor& codes, const at::Tensor& scales,
                                                   const at::Tensor& centres, int64_t tokens,
                                                   int64_t channels, int64_t bits,
                                                   int64_t block_size) {
  const bool packs_int4 = packs_int4_for(bits);
  check_block_size(block_size, packs_int4);
  TORCH_CHECK(tokens > 0 && channels > 0, "tokens and channels must be positive, got ", tokens,
              " and ", channels);
  check_dtype(scales, at::kFloat, "scales");
  check_float_dtype(centres.scalar_type(), "centres");
  check_numel(centres, scales.numel(), "centres");
  const int64_t per_lead = channels * num_blocks(tokens, block_size);
  TORCH_CHECK(scales.numel() % per_lead == 0, "scales must hold whole channels of ", per_lead,
              " blocks each, got ", scales.numel());
  const TokenBlocks blocks{scales.numel() / per_lead, tokens, channels,
                           num_blocks(tokens, block_size), block_size};
  check_dtype(codes, packs_int4 ? at::kByte : at::kChar, "codes");
  check_numel(codes, packs_int4 ? blocks.padded_numel() / 2 : blocks.padded_numel(), "codes");
  check_same_device(codes, scales, "codes", "scales");
  check_same_device(codes, centres, "codes", "centres");
  return blocks;
}

}  // namespace lazyzero::quant
