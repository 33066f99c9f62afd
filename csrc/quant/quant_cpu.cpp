// CPU kernels of block-wise int8/int4 quantization (spec: lazyzero/ops/quant_reference.py).
//
// Work is split over blocks with OpenMP (lazyzero/parallel.h). Each block is read twice,
// once for its absmax and once to quantize it, and stays in L1 in between, so the input streams
// from memory once. One block's quantization: quant/quant_block_cpu.h.
#include "quant/quant_cpu.h"

#include <lazyzero/dispatch.h>
#include <lazyzero/parallel.h>
#include <lazyzero/quant_math.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "quant/quant_block_cpu.h"
#include "quant/quant_common.h"

namespace lazyzero::quant {
namespace {

// Elements per parallel task: large enough that OpenMP scheduling costs are noise.
constexpr int64_t kElementsPerTask = 1 << 16;

int64_t blocks_per_task(int64_t block_size) {
  return std::max<int64_t>(1, kElementsPerTask / block_size);
}

// One block as fp32: fp32 input is read in place, bf16/fp16 are widened into `scratch`.
template <typename T>
const float* block_as_float(const T* src, int64_t len, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < len; ++i) scratch[i] = static_cast<float>(src[i]);
    return scratch;
  }
}

// The first position in `x` whose abs_bits equal `max_bits`, as a min-reduction gcc vectorizes.
int32_t first_position_of(const float* x, int32_t len, uint32_t max_bits) {
  int32_t first = len;
  for (int32_t i = 0; i < len; ++i) {
    const int32_t candidate = abs_bits(x[i]) == max_bits ? i : len;
    first = candidate < first ? candidate : first;
  }
  return first;
}

// The block's largest-magnitude element (first on ties, NaN above Inf above finite: abs_bits order)
// is copied to `outlier` and replaced by 0 in `block`, which the caller then quantizes. Found by two
// reductions gcc vectorizes (the maximum, then its first position): a single loop tracking the
// running argmax does not vectorize, and took 3.5x a plain quantization.
void take_block_outlier(float* block, int64_t len, float* outlier_value, uint8_t* outlier_index) {
  const uint32_t max_bits = block_absmax_bits(block, len);
  const int32_t index = first_position_of(block, static_cast<int32_t>(len), max_bits);
  *outlier_value = block[index];
  *outlier_index = static_cast<uint8_t>(index);
  block[index] = 0.0f;
}

// Where each block's outlier goes (quant_reference: "Block outliers"); null: none is taken out.
struct OutlierOutputs {
  float* values = nullptr;
  uint8_t* index = nullptr;
};

// kPackInt4: `out` is uint8 [ceil(n/2)], else int8 [n]. block_size is even when packing, so block b
// starts at byte b * block_size / 2. With `outliers`, each block is copied to `widened` (it is
// modified; it stays in L1) and its outlier taken out before it is quantized.
template <typename T, bool kPackInt4>
void quantize_blocks(const at::Tensor& x, int64_t block_size, const Rounding& rounding,
                     const at::Tensor& out, const at::Tensor& scales,
                     OutlierOutputs outliers = {}) {
  const T* src = x.const_data_ptr<T>();
  float* scale_data = scales.mutable_data_ptr<float>();
  void* out_data = out.data_ptr();
  const int64_t n = x.numel();
  const bool takes_outliers = outliers.values != nullptr;
  parallel_for_tasks(scales.numel(), blocks_per_task(block_size), [&](int64_t begin, int64_t end) {
    std::vector<float> widened(std::is_same_v<T, float> && !takes_outliers ? 0 : block_size);
    std::vector<float> uniforms(rounding.stochastic ? block_size : 0);
    std::vector<int8_t> unpacked(kPackInt4 ? block_size : 0);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * block_size;
      const int64_t len = std::min(block_size, n - start);
      const float* block = nullptr;
      if (takes_outliers) {
        for (int64_t i = 0; i < len; ++i) widened[i] = static_cast<float>(src[start + i]);
        take_block_outlier(widened.data(), len, outliers.values + b, outliers.index + b);
        block = widened.data();
      } else {
        block = block_as_float(src + start, len, widened.data());
      }
      int8_t* codes = kPackInt4 ? unpacked.data() : static_cast<int8_t*>(out_data) + start;
      scale_data[b] = quantize_block(block, len, start, rounding, uniforms.data(), codes);
      if constexpr (kPackInt4) pack_int4(codes, len, static_cast<uint8_t*>(out_data) + start / 2);
    }
  });
}

// Fills checked, contiguous `codes` and `scales`.
void quantize_into(const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed,
                   bool packs_int4, const at::Tensor& codes, const at::Tensor& scales) {
  const at::Tensor input = x.contiguous();
  const Rounding rounding{packs_int4 ? kInt4Max : kInt8Max, stochastic, stream_key(seed)};
  LZ_DISPATCH_FLOAT_TYPES(input.scalar_type(), "lazyzero::quantize", [&] {
    if (packs_int4) {
      quantize_blocks<scalar_t, true>(input, block_size, rounding, codes, scales);
    } else {
      quantize_blocks<scalar_t, false>(input, block_size, rounding, codes, scales);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, int64_t block_size,
                                                bool stochastic, int64_t seed, bool packs_int4) {
  auto [codes, scales] = allocate_quantize_outputs(x, block_size, packs_int4);
  quantize_into(x, block_size, stochastic, seed, packs_int4, codes, scales);
  return {codes, scales};
}

// Calls per_block(b, start, len) for each block of an n-element tensor, blocks spread over threads.
template <typename PerBlock>
void parallel_for_blocks(int64_t n, int64_t block_size, const PerBlock& per_block) {
  parallel_for_tasks(num_blocks(n, block_size), blocks_per_task(block_size),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t b = begin; b < end; ++b) {
                         const int64_t start = b * block_size;
                         per_block(b, start, std::min(block_size, n - start));
                       }
                     });
}

template <typename OutT>
void dequantize_int8_block(const int8_t* codes, int64_t len, float scale, OutT* out) {
  for (int64_t i = 0; i < len; ++i) out[i] = static_cast<OutT>(dequantize_code(codes[i], scale));
}

template <typename OutT>
void dequantize_int4_block(const uint8_t* packed, int64_t len, float scale, OutT* out) {
  for (int64_t j = 0; j < len / 2; ++j) {
    out[2 * j] = static_cast<OutT>(dequantize_code(low_nibble_code(packed[j]), scale));
    out[2 * j + 1] = static_cast<OutT>(dequantize_code(high_nibble_code(packed[j]), scale));
  }
  if (len % 2 != 0) {
    out[len - 1] = static_cast<OutT>(dequantize_code(low_nibble_code(packed[len / 2]), scale));
  }
}

// out[i] = fp32(alpha) * (((0 + c0*s0) + c1*s1) + ...), accumulated in `out` itself one block at a
// time so the partial sums stay in L1 while the K rows stream past.
void dequantize_sum_blocks(const at::Tensor& codes, const at::Tensor& scales, int64_t block_size,
                           float alpha, float* out) {
  const int8_t* code_data = codes.const_data_ptr<int8_t>();
  const float* scale_data = scales.const_data_ptr<float>();
  const int64_t rows = codes.size(0);
  const int64_t n = codes.size(1);
  const int64_t blocks_per_row = num_blocks(n, block_size);
  parallel_for_blocks(n, block_size, [&](int64_t b, int64_t start, int64_t len) {
    float* acc = out + start;
    std::fill(acc, acc + len, 0.0f);
    for (int64_t k = 0; k < rows; ++k) {
      const int8_t* row = code_data + k * n + start;
      const float scale = scale_data[k * blocks_per_row + b];
      for (int64_t i = 0; i < len; ++i) acc[i] = add_rn(acc[i], dequantize_code(row[i], scale));
    }
    for (int64_t i = 0; i < len; ++i) acc[i] = mul_rn(acc[i], alpha);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_outliers_cpu(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed, bool packs_int4) {
  check_outlier_block_size(block_size);
  auto [codes, scales] = allocate_quantize_outputs(x, block_size, packs_int4);
  auto [values, index] = allocate_outlier_outputs(x, block_size);
  const at::Tensor input = x.contiguous();
  const Rounding rounding{packs_int4 ? kInt4Max : kInt8Max, stochastic, stream_key(seed)};
  const OutlierOutputs outliers{values.mutable_data_ptr<float>(), index.mutable_data_ptr<uint8_t>()};
  LZ_DISPATCH_FLOAT_TYPES(input.scalar_type(), "lazyzero::quantize_outliers", [&] {
    if (packs_int4) {
      quantize_blocks<scalar_t, true>(input, block_size, rounding, codes, scales, outliers);
    } else {
      quantize_blocks<scalar_t, false>(input, block_size, rounding, codes, scales, outliers);
    }
  });
  return {codes, scales, values, index};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_int8_outliers_cpu(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed) {
  return quantize_outliers_cpu(x, block_size, stochastic, seed, /*packs_int4=*/false);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_int4_outliers_cpu(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed) {
  return quantize_outliers_cpu(x, block_size, stochastic, seed, /*packs_int4=*/true);
}

void restore_block_outliers_cpu(const at::Tensor& out, const at::Tensor& values,
                                const at::Tensor& index, int64_t block_size) {
  check_restore_outliers_args(out, values, index, block_size);
  const at::Tensor value_data = values.contiguous();
  const at::Tensor index_data = index.contiguous();
  const float* value_ptr = value_data.const_data_ptr<float>();
  const uint8_t* index_ptr = index_data.const_data_ptr<uint8_t>();
  LZ_DISPATCH_FLOAT_TYPES(out.scalar_type(), "lazyzero::restore_block_outliers_", [&] {
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    // One store per block, each to a cache line the dequantization wrote and evicted: bound by
    // memory latency, so spread over threads like the dequantization itself.
    parallel_for_tasks(values.numel(), blocks_per_task(block_size), [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        out_ptr[b * block_size + index_ptr[b]] = static_cast<scalar_t>(value_ptr[b]);
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_cpu(const at::Tensor& x, int64_t block_size,
                                                     bool stochastic, int64_t seed) {
  return quantize_cpu(x, block_size, stochastic, seed, /*packs_int4=*/false);
}

std::tuple<at::Tensor, at::Tensor> quantize_int4_cpu(const at::Tensor& x, int64_t block_size,
                                                     bool stochastic, int64_t seed) {
  return quantize_cpu(x, block_size, stochastic, seed, /*packs_int4=*/true);
}

void quantize_int8_into_cpu(const at::Tensor& x, int64_t block_size, bool stochastic,
                            int64_t seed, const at::Tensor& codes, const at::Tensor& scales) {
  check_quantize_destinations(x, block_size, codes, scales);
  quantize_into(x, block_size, stochastic, seed, /*packs_int4=*/false, codes, scales);
}

void dequantize_int8_into_cpu(const at::Tensor& codes, const at::Tensor& scales,
                              int64_t block_size, const at::Tensor& out) {
  check_dequantize_int8_args(codes, scales, block_size, out.scalar_type());
  check_dequantize_destination(out, codes);
  const at::Tensor code_data = codes.contiguous();
  const at::Tensor scale_data = scales.contiguous();
  const int8_t* code_ptr = code_data.const_data_ptr<int8_t>();
  const float* scale_ptr = scale_data.const_data_ptr<float>();
  LZ_DISPATCH_FLOAT_TYPES(out.scalar_type(), "lazyzero::dequantize_int8", [&] {
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    parallel_for_blocks(codes.numel(), block_size, [&](int64_t b, int64_t start, int64_t len) {
      dequantize_int8_block(code_ptr + start, len, scale_ptr[b], out_ptr + start);
    });
  });
}

at::Tensor dequantize_int8_cpu(const at::Tensor& codes, const at::Tensor& scales,
                               int64_t block_size, at::ScalarType out_dtype) {
  check_dequantize_int8_args(codes, scales, block_size, out_dtype);
  at::Tensor out = at::empty({codes.numel()}, codes.options().dtype(out_dtype));
  dequantize_int8_into_cpu(codes, scales, block_size, out);
  return out;
}

at::Tensor dequantize_int4_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                               int64_t block_size, at::ScalarType out_dtype) {
  check_dequantize_int4_args(packed, scales, numel, block_size, out_dtype);
  const at::Tensor packed_data = packed.contiguous();
  const at::Tensor scale_data = scales.contiguous();
  at::Tensor out = at::empty({numel}, packed.options().dtype(out_dtype));
  const uint8_t* packed_ptr = packed_data.const_data_ptr<uint8_t>();
  const float* scale_ptr = scale_data.const_data_ptr<float>();
  LZ_DISPATCH_FLOAT_TYPES(out_dtype, "lazyzero::dequantize_int4", [&] {
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    parallel_for_blocks(numel, block_size, [&](int64_t b, int64_t start, int64_t len) {
      dequantize_int4_block(packed_ptr + start / 2, len, scale_ptr[b], out_ptr + start);
    });
  });
  return out;
}

void dequantize_sum_int8_into_cpu(const at::Tensor& codes, const at::Tensor& scales,
                                  int64_t block_size, double alpha, const at::Tensor& out) {
  check_dequantize_sum_args(codes, scales, block_size);
  check_sum_destination(out, codes);
  dequantize_sum_blocks(codes.contiguous(), scales.contiguous(), block_size,
                        static_cast<float>(alpha), out.mutable_data_ptr<float>());
}

at::Tensor dequantize_sum_int8_cpu(const at::Tensor& codes, const at::Tensor& scales,
                                   int64_t block_size, double alpha) {
  check_dequantize_sum_args(codes, scales, block_size);
  at::Tensor out = at::empty({codes.size(1)}, codes.options().dtype(at::kFloat));
  dequantize_sum_int8_into_cpu(codes, scales, block_size, alpha, out);
  return out;
}

}  // namespace lazyzero::quant
