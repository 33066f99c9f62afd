// One block's quantization on the CPU, shared by the kernels of csrc/quant/*_cpu.cpp (spec:
// lazyzero/ops/quant_reference.py). Inner loops are plain counted loops over contiguous fp32 with
// branch-free bodies so that gcc -O3 vectorizes them; per-block decisions (zero / non-finite) are
// made once, outside those loops.
#pragma once

#include <lazyzero/quant_math.h>

#include <cstdint>
#include <cstring>

namespace lazyzero::quant {

inline uint32_t block_absmax_bits(const float* x, int64_t len) {
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t bits = abs_bits(x[i]);
    max_bits = bits > max_bits ? bits : max_bits;
  }
  return max_bits;
}

inline void nearest_codes(const float* x, int64_t len, float scale, float qmax, int8_t* codes) {
  for (int64_t i = 0; i < len; ++i) {
    codes[i] = static_cast<int8_t>(static_cast<int32_t>(nearest_code(x[i], scale, qmax)));
  }
}

// Uniforms are drawn in their own loop: gcc vectorizes the 64-bit hash alone but not fused with
// the fp32 quantization.
inline void stochastic_codes(const float* x, int64_t len, int64_t first_index, float scale,
                             const Rounding& rounding, float* uniforms, int8_t* codes) {
  for (int64_t i = 0; i < len; ++i) uniforms[i] = uniform_at(rounding.key, first_index + i);
  for (int64_t i = 0; i < len; ++i) {
    const float code = stochastic_code(x[i], scale, rounding.qmax, uniforms[i]);
    codes[i] = static_cast<int8_t>(static_cast<int32_t>(code));
  }
}

inline void nonfinite_codes(const float* x, int64_t len, float qmax, int8_t* codes) {
  for (int64_t i = 0; i < len; ++i) {
    codes[i] = static_cast<int8_t>(static_cast<int32_t>(nonfinite_block_code(x[i], qmax)));
  }
}

// Writes the int8 codes of one block and returns its scale.
inline float quantize_block(const float* x, int64_t len, int64_t first_index,
                            const Rounding& rounding, float* uniforms, int8_t* codes) {
  const float scale = scale_from_absmax_bits(block_absmax_bits(x, len), rounding.qmax);
  switch (classify_block(scale)) {
    case BlockKind::kZero:
      std::memset(codes, 0, len);
      break;
    case BlockKind::kNonFinite:
      nonfinite_codes(x, len, rounding.qmax, codes);
      break;
    case BlockKind::kFinite:
      if (rounding.stochastic) {
        stochastic_codes(x, len, first_index, scale, rounding, uniforms, codes);
      } else {
        nearest_codes(x, len, scale, rounding.qmax, codes);
      }
      break;
  }
  return scale;
}

// `len` codes -> ceil(len/2) bytes; the high nibble of a trailing odd code is 0.
inline void pack_int4(const int8_t* codes, int64_t len, uint8_t* packed) {
  const int64_t pairs = len / 2;
  for (int64_t j = 0; j < pairs; ++j) packed[j] = pack_nibbles(codes[2 * j], codes[2 * j + 1]);
  if (len % 2 != 0) packed[pairs] = pack_nibbles(codes[len - 1], 0);
}

}  // namespace lazyzero::quant
