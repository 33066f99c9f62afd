// CUDA kernels of block-wise int8/int4 quantization (spec: lazyzero/ops/quant_reference.py).
//
// Quantization gives each block to one warp: the lanes stride over the block for its absmax, reduce
// it with shuffles, then stride again to write codes, so the block-level decisions (zero /
// non-finite) are uniform across the warp. Dequantization and the fused dequantize-sum are
// element-wise grid-stride loops. All fp32 arithmetic goes through lazyzero/quant_math.h, whose
// explicit round-to-nearest intrinsics keep the results bit-identical to the CPU kernels.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <lazyzero/dispatch.h>
#include <lazyzero/quant_math.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "quant/quant_common.h"
#include "quant/quant_cuda_common.cuh"

namespace lazyzero::quant {
namespace {

__device__ __forceinline__ uint64_t warp_max64(uint64_t value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const uint64_t other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = other > value ? other : value;
  }
  return value;
}

// Index of the block's largest-magnitude element, the first on ties (quant_reference: "Block
// outliers"): the warp maximizes (abs bits, ~index) as one 64-bit key.
template <typename T>
__device__ __forceinline__ int64_t block_outlier_index(const T* x, int64_t len, int lane) {
  uint64_t best = 0;
  for (int64_t i = lane; i < len; i += kWarpSize) {
    const uint64_t key = (static_cast<uint64_t>(abs_bits(static_cast<float>(x[i]))) << 32) |
                         (0xffffffffu - static_cast<uint32_t>(i));
    best = key > best ? key : best;
  }
  return 0xffffffffu - static_cast<uint32_t>(warp_max64(best) & 0xffffffffu);
}

// out: int8 [n] codes, or uint8 [ceil(n/2)] packed int4 codes when kPackInt4 (block_size is even
// then, so block b starts at byte b * block_size / 2). With kTakeOutliers, each block's outlier
// (quant_reference: "Block outliers") reads as 0 and is written to values / index (one byte:
// block_size <= 256); without, those are null and nothing reads as 0.
template <typename T, bool kPackInt4, bool kTakeOutliers>
__global__ void quantize_kernel(const T* x, int64_t n, int64_t block_size, int64_t nblocks,
                                Rounding rounding, void* out, float* scales, float* values,
                                uint8_t* index) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = grid_threads() / kWarpSize;
  for (int64_t b = global_thread_index() / kWarpSize; b < nblocks; b += warps) {
    const int64_t start = b * block_size;
    const int64_t len = n - start < block_size ? n - start : block_size;
    const T* block = x + start;
    const int64_t outlier = kTakeOutliers ? block_outlier_index(block, len, lane) : -1;
    const auto element = [&](int64_t i) {
      return i == outlier ? 0.0f : static_cast<float>(block[i]);
    };
    uint32_t max_bits = 0;
    for (int64_t i = lane; i < len; i += kWarpSize) max_bits = max(max_bits, abs_bits(element(i)));
    const float scale = scale_from_absmax_bits(warp_max(max_bits), rounding.qmax);
    const BlockKind kind = classify_block(scale);
    if (lane == 0) {
      scales[b] = scale;
      if constexpr (kTakeOutliers) {
        values[b] = static_cast<float>(block[outlier]);
        index[b] = static_cast<uint8_t>(outlier);
      }
    }
    if constexpr (kPackInt4) {
      uint8_t* packed = static_cast<uint8_t*>(out) + start / 2;
      for (int64_t j = lane; j < (len + 1) / 2; j += kWarpSize) {
        const int64_t i = 2 * j;
        const int32_t low = element_code(element(i), scale, kind, rounding, start + i);
        const int32_t high =
            i + 1 < len ? element_code(element(i + 1), scale, kind, rounding, start + i + 1) : 0;
        packed[j] = pack_nibbles(low, high);
      }
    } else {
      int8_t* codes = static_cast<int8_t*>(out) + start;
      for (int64_t i = lane; i < len; i += kWarpSize) {
        codes[i] = static_cast<int8_t>(element_code(element(i), scale, kind, rounding, start + i));
      }
    }
  }
}

template <typename OutT>
__global__ void restore_outliers_kernel(const float* values, const uint8_t* index,
                                        int64_t nblocks, int64_t block_size, OutT* out) {
  for (int64_t b = global_thread_index(); b < nblocks; b += grid_threads()) {
    out[b * block_size + index[b]] = static_cast<OutT>(values[b]);
  }
}

template <typename OutT>
__global__ void dequantize_int8_kernel(const int8_t* codes, const float* scales, int64_t n,
                                       int64_t block_size, OutT* out) {
  for (int64_t i = global_thread_index(); i < n; i += grid_threads()) {
    out[i] = static_cast<OutT>(dequantize_code(codes[i], scales[i / block_size]));
  }
}

template <typename OutT>
__global__ void dequantize_int4_kernel(const uint8_t* packed, const float* scales, int64_t n,
                                       int64_t block_size, OutT* out) {
  for (int64_t i = global_thread_index(); i < n; i += grid_threads()) {
    const uint8_t byte = packed[i / 2];
    const int32_t code = (i % 2 == 0) ? low_nibble_code(byte) : high_nibble_code(byte);
    out[i] = static_cast<OutT>(dequantize_code(code, scales[i / block_size]));
  }
}

// out[i] = fp32(alpha) * (((0 + c0*s0) + c1*s1) + ...), the reference's order and roundings.
__global__ void dequantize_sum_kernel(const int8_t* codes, const float* scales, int64_t rows,
                                      int64_t n, int64_t block_size, float alpha, float* out) {
  const int64_t blocks_per_row = (n + block_size - 1) / block_size;
  for (int64_t i = global_thread_index(); i < n; i += grid_threads()) {
    const int64_t block = i / block_size;
    float acc = 0.0f;
    for (int64_t k = 0; k < rows; ++k) {
      acc = add_rn(acc, dequantize_code(codes[k * n + i], scales[k * blocks_per_row + block]));
    }
    out[i] = mul_rn(acc, alpha);
  }
}

// Fills checked, contiguous `codes` and `scales`.
void quantize_into(const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed,
                   bool packs_int4, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t nblocks = scales.numel();
  if (nblocks == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  const Rounding rounding{packs_int4 ? kInt4Max : kInt8Max, stochastic, stream_key(seed)};
  const int64_t ctas = ctas_for(nblocks * kWarpSize);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LZ_DISPATCH_FLOAT_TYPES(input.scalar_type(), "lazyzero::quantize", [&] {
    const auto kernel = packs_int4 ? quantize_kernel<scalar_t, true, false>
                                   : quantize_kernel<scalar_t, false, false>;
    kernel<<<ctas, kThreadsPerCta, 0, stream>>>(input.const_data_ptr<scalar_t>(), input.numel(),
                                                block_size, nblocks, rounding, codes.data_ptr(),
                                                scales.mutable_data_ptr<float>(), nullptr, nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t block_size,
                                                 bool stochastic, int64_t seed, bool packs_int4) {
  auto [codes, scales] = allocate_quantize_outputs(x, block_size, packs_int4);
  quantize_into(x, block_size, stochastic, seed, packs_int4, codes, scales);
  return {codes, scales};
}

std::tuple<at::Tensor, at::Tensor> quantize_int8_cuda(const at::Tensor& x, int64_t block_size,
                                                      bool stochastic, int64_t seed) {
  return quantize_cuda(x, block_size, stochastic, seed, /*packs_int4=*/false);
}

std::tuple<at::Tensor, at::Tensor> quantize_int4_cuda(const at::Tensor& x, int64_t block_size,
                                                      bool stochastic, int64_t seed) {
  return quantize_cuda(x, block_size, stochastic, seed, /*packs_int4=*/true);
}

void quantize_int8_into_cuda(const at::Tensor& x, int64_t block_size, bool stochastic,
                             int64_t seed, const at::Tensor& codes, const at::Tensor& scales) {
  check_quantize_destinations(x, block_size, codes, scales);
  quantize_into(x, block_size, stochastic, seed, /*packs_int4=*/false, codes, scales);
}

void dequantize_int8_into_cuda(const at::Tensor& codes, const at::Tensor& scales,
                               int64_t block_size, const at::Tensor& out) {
  check_dequantize_int8_args(codes, scales, block_size, out.scalar_type());
  check_dequantize_destination(out, codes);
  if (codes.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(codes.device());
  const at::Tensor code_data = codes.contiguous();
  const at::Tensor scale_data = scales.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LZ_DISPATCH_FLOAT_TYPES(out.scalar_type(), "lazyzero::dequantize_int8", [&] {
    dequantize_int8_kernel<scalar_t><<<ctas_for(codes.numel()), kThreadsPerCta, 0, stream>>>(
        code_data.const_data_ptr<int8_t>(), scale_data.const_data_ptr<float>(), codes.numel(),
        block_size, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor dequantize_int8_cuda(const at::Tensor& codes, const at::Tensor& scales,
                                int64_t block_size, at::ScalarType out_dtype) {
  check_dequantize_int8_args(codes, scales, block_size, out_dtype);
  at::Tensor out = at::empty({codes.numel()}, codes.options().dtype(out_dtype));
  dequantize_int8_into_cuda(codes, scales, block_size, out);
  return out;
}

at::Tensor dequantize_int4_cuda(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                                int64_t block_size, at::ScalarType out_dtype) {
  check_dequantize_int4_args(packed, scales, numel, block_size, out_dtype);
  at::Tensor out = at::empty({numel}, packed.options().dtype(out_dtype));
  if (numel == 0) return out;
  const c10::cuda::CUDAGuard guard(packed.device());
  const at::Tensor packed_data = packed.contiguous();
  const at::Tensor scale_data = scales.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LZ_DISPATCH_FLOAT_TYPES(out_dtype, "lazyzero::dequantize_int4", [&] {
    dequantize_int4_kernel<scalar_t><<<ctas_for(numel), kThreadsPerCta, 0, stream>>>(
        packed_data.const_data_ptr<uint8_t>(), scale_data.const_data_ptr<float>(), numel,
        block_size, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void dequantize_sum_int8_into_cuda(const at::Tensor& codes, const at::Tensor& scales,
                                   int64_t block_size, double alpha, const at::Tensor& out) {
  check_dequantize_sum_args(codes, scales, block_size);
  check_sum_destination(out, codes);
  const int64_t n = codes.size(1);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(codes.device());
  const at::Tensor code_data = codes.contiguous();
  const at::Tensor scale_data = scales.contiguous();
  dequantize_sum_kernel<<<ctas_for(n), kThreadsPerCta, 0, c10::cuda::getCurrentCUDAStream()>>>(
      code_data.const_data_ptr<int8_t>(), scale_data.const_data_ptr<float>(), codes.size(0), n,
      block_size, static_cast<float>(alpha), out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor dequantize_sum_int8_cuda(const at::Tensor& codes, const at::Tensor& scales,
                                    int64_t block_size, double alpha) {
  check_dequantize_sum_args(codes, scales, block_size);
  at::Tensor out = at::empty({codes.size(1)}, codes.options().dtype(at::kFloat));
  dequantize_sum_int8_into_cuda(codes, scales, block_size, alpha, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_outliers_cuda(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed, bool packs_int4) {
  check_outlier_block_size(block_size);
  auto [codes, scales] = allocate_quantize_outputs(x, block_size, packs_int4);
  auto [values, index] = allocate_outlier_outputs(x, block_size);
  const int64_t nblocks = scales.numel();
  if (nblocks == 0) return {codes, scales, values, index};
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  const Rounding rounding{packs_int4 ? kInt4Max : kInt8Max, stochastic, stream_key(seed)};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LZ_DISPATCH_FLOAT_TYPES(input.scalar_type(), "lazyzero::quantize_outliers", [&] {
    const auto kernel = packs_int4 ? quantize_kernel<scalar_t, true, true>
                                   : quantize_kernel<scalar_t, false, true>;
    kernel<<<ctas_for(nblocks * kWarpSize), kThreadsPerCta, 0, stream>>>(
        input.const_data_ptr<scalar_t>(), input.numel(), block_size, nblocks, rounding,
        codes.data_ptr(), scales.mutable_data_ptr<float>(), values.mutable_data_ptr<float>(),
        index.mutable_data_ptr<uint8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {codes, scales, values, index};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_int8_outliers_cuda(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed) {
  return quantize_outliers_cuda(x, block_size, stochastic, seed, /*packs_int4=*/false);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_int4_outliers_cuda(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed) {
  return quantize_outliers_cuda(x, block_size, stochastic, seed, /*packs_int4=*/true);
}

void restore_block_outliers_cuda(const at::Tensor& out, const at::Tensor& values,
                                 const at::Tensor& index, int64_t block_size) {
  check_restore_outliers_args(out, values, index, block_size);
  const int64_t nblocks = values.numel();
  if (nblocks == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor value_data = values.contiguous();
  const at::Tensor index_data = index.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LZ_DISPATCH_FLOAT_TYPES(out.scalar_type(), "lazyzero::restore_block_outliers_", [&] {
    restore_outliers_kernel<scalar_t><<<ctas_for(nblocks), kThreadsPerCta, 0, stream>>>(
        value_data.const_data_ptr<float>(), index_data.const_data_ptr<uint8_t>(), nblocks,
        block_size, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace lazyzero::quant

TORCH_LIBRARY_IMPL(lazyzero, CUDA, m) {
  using namespace lazyzero::quant;
  m.impl("quantize_int8", &quantize_int8_cuda);
  m.impl("quantize_int8_into", &quantize_int8_into_cuda);
  m.impl("quantize_int4", &quantize_int4_cuda);
  m.impl("dequantize_int8", &dequantize_int8_cuda);
  m.impl("dequantize_int8_into", &dequantize_int8_into_cuda);
  m.impl("dequantize_int4", &dequantize_int4_cuda);
  m.impl("dequantize_sum_int8", &dequantize_sum_int8_cuda);
  m.impl("dequantize_sum_int8_into", &dequantize_sum_int8_into_cuda);
  m.impl("quantize_int8_outliers", &quantize_int8_outliers_cuda);
  m.impl("quantize_int4_outliers", &quantize_int4_outliers_cuda);
  m.impl("restore_block_outliers_", &restore_block_outliers_cuda);
}
