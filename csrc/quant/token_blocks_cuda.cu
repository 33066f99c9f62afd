// CUDA kernels of centred blocks along tokens (spec: lazyzero/ops/quant_reference.py, "Blocks along
// tokens"), the form an attention's query and key are stored in (lazyzero/activations/by_channel.py).
//
// Quantization gives each block to one warp, which reads the block's column of the storage where it
// lies (the last token again for the padding): one pass for its range, one for the absmax of the
// centred values, one to write codes, the last two from cache. Warps are numbered channel first, so
// the warps of a CTA read neighbouring channels of the same rows and share their cache lines; the
// warp's decisions (centre, zero / non-finite block) are uniform across its lanes. Restoring is an
// element-wise grid-stride loop over the storage, which it writes in order.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <lazyzero/dispatch.h>
#include <lazyzero/quant_math.h>
#include <torch/library.h>

#include <tuple>

#include "quant/quant_common.h"
#include "quant/quant_cuda_common.cuh"

namespace lazyzero::quant {
namespace {

__device__ __forceinline__ float warp_min_float(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = other < value ? other : value;
  }
  return value;
}

__device__ __forceinline__ float warp_max_float(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = other > value ? other : value;
  }
  return value;
}

// One block's elements as the warp reads them: element i is token min(first + i, tokens - 1) of
// one channel.
template <typename T>
struct TokenColumn {
  const T* column;  // the channel's element of the lead index's first token
  int64_t channels;
  int64_t first_token;
  int64_t last_token;

  __device__ __forceinline__ float operator()(int64_t i) const {
    const int64_t token = first_token + i < last_token ? first_token + i : last_token;
    return static_cast<float>(column[token * channels]);
  }
};

// The middle of the block's range in fp32, NaN when the block holds a NaN; the same on every lane.
template <typename T>
__device__ __forceinline__ float block_centre(const TokenColumn<T>& element, int64_t len, int lane) {
  float low = element(0);
  float high = low;
  bool any_nan = false;
  for (int64_t i = lane; i < len; i += kWarpSize) {
    const float value = element(i);
    low = value < low ? value : low;
    high = value > high ? value : high;
    any_nan |= value != value;
  }
  if (__any_sync(0xffffffffu, any_nan)) return float_of(kQuietNanBits);
  return div_rn(add_rn(warp_min_float(low), warp_max_float(high)), 2.0f);
}

template <typename T, bool kPackInt4>
__global__ void quantize_token_blocks_kernel(const T* x, TokenBlocks blocks, int64_t nblocks,
                                             Rounding rounding, void* codes, float* scales,
                                             T* centres) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps = grid_threads() / kWarpSize;
  const int64_t block_size = blocks.block_size;
  for (int64_t w = global_thread_index() / kWarpSize; w < nblocks; w += warps) {
    const int64_t channel = w % blocks.channels;
    const int64_t token_block = w / blocks.channels % blocks.token_blocks;
    const int64_t lead = w / blocks.channels / blocks.token_blocks;
    const int64_t b = (lead * blocks.channels + channel) * blocks.token_blocks + token_block;
    const TokenColumn<T> element{x + lead * blocks.tokens * blocks.channels + channel,
                                 blocks.channels, token_block * block_size, blocks.tokens - 1};
    const T centre = static_cast<T>(block_centre(element, block_size, lane));
    const float stored_centre = static_cast<float>(centre);
    const auto centred = [&](int64_t i) { return add_rn(element(i), -stored_centre); };
    uint32_t max_bits = 0;
    for (int64_t i = lane; i < block_size; i += kWarpSize) max_bits = max(max_bits, abs_bits(centred(i)));
    const float scale = scale_from_absmax_bits(warp_max(max_bits), rounding.qmax);
    const BlockKind kind = classify_block(scale);
    if (lane == 0) {
      scales[b] = scale;
      centres[b] = centre;
    }
    const int64_t start = b * block_size;
    if constexpr (kPackInt4) {
      uint8_t* packed = static_cast<uint8_t*>(codes) + start / 2;
      for (int64_t j = lane; j < block_size / 2; j += kWarpSize) {
        const int64_t i = 2 * j;
        packed[j] = pack_nibbles(element_code(centred(i), scale, kind, rounding, start + i),
                                 element_code(centred(i + 1), scale, kind, rounding, start + i + 1));
      }
    } else {
      int8_t* out = static_cast<int8_t*>(codes) + start;
      for (int64_t i = lane; i < block_size; i += kWarpSize) {
        out[i] = static_cast<int8_t>(element_code(centred(i), scale, kind, rounding, start + i));
      }
    }
  }
}

template <typename T, bool kPackInt4>
__global__ void restore_token_blocks_kernel(const void* codes, const float* scales,
                                            const T* centres, TokenBlocks blocks, int64_t n,
                                            T* out) {
  for (int64_t index = global_thread_index(); index < n; index += grid_threads()) {
    const int64_t channel = index % blocks.channels;
    const int64_t token = index / blocks.channels % blocks.tokens;
    const int64_t lead = index / blocks.channels / blocks.tokens;
    const int64_t b = (lead * blocks.channels + channel) * blocks.token_blocks +
                      token / blocks.block_size;
    const int64_t at = b * blocks.block_size + token % blocks.block_size;
    int32_t code = 0;
    if constexpr (kPackInt4) {
      const uint8_t byte = static_cast<const uint8_t*>(codes)[at / 2];
      code = at % 2 == 0 ? low_nibble_code(byte) : high_nibble_code(byte);
    } else {
      code = static_cast<const int8_t*>(codes)[at];
    }
    const float centre = static_cast<float>(centres[b]);
    out[index] = static_cast<T>(add_rn(dequantize_code(code, scales[b]), centre));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_token_blocks_cuda(
    const at::Tensor& x, int64_t tokens, int64_t channels, int64_t bits, int64_t block_size,
    bool stochastic, int64_t seed) {
  const TokenBlocks blocks = check_quantize_token_blocks_args(x, tokens, channels, bits, block_size);
  const bool packs_int4 = packs_int4_for(bits);
  auto [codes, scales, centres] = allocate_token_block_outputs(x, blocks, packs_int4);
  const int64_t nblocks = blocks.count();
  if (nblocks == 0) return {codes, scales, centres};
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor input = x.contiguous();
  const Rounding rounding{packs_int4 ? kInt4Max : kInt8Max, stochastic, stream_key(seed)};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LZ_DISPATCH_FLOAT_TYPES(input.scalar_type(), "lazyzero::quantize_token_blocks", [&] {
    const auto kernel = packs_int4 ? quantize_token_blocks_kernel<scalar_t, true>
                                   : quantize_token_blocks_kernel<scalar_t, false>;
    kernel<<<ctas_for(nblocks * kWarpSize), kThreadsPerCta, 0, stream>>>(
        input.const_data_ptr<scalar_t>(), blocks, nblocks, rounding, codes.data_ptr(),
        scales.mutable_data_ptr<float>(), centres.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {codes, scales, centres};
}

at::Tensor restore_token_blocks_cuda(const at::Tensor& codes, const at::Tensor& scales,
                                     const at::Tensor& centres, int64_t tokens, int64_t channels,
                                     int64_t bits, int64_t block_size) {
  const TokenBlocks blocks =
      check_restore_token_blocks_args(codes, scales, centres, tokens, channels, bits, block_size);
  const int64_t n = blocks.lead * tokens * channels;
  at::Tensor out = at::empty({n}, centres.options());
  if (n == 0) return out;
  const c10::cuda::CUDAGuard guard(codes.device());
  const at::Tensor code_data = codes.contiguous();
  const at::Tensor scale_data = scales.contiguous();
  const at::Tensor centre_data = centres.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  LZ_DISPATCH_FLOAT_TYPES(centres.scalar_type(), "lazyzero::restore_token_blocks", [&] {
    const auto kernel = packs_int4_for(bits) ? restore_token_blocks_kernel<scalar_t, true>
                                             : restore_token_blocks_kernel<scalar_t, false>;
    kernel<<<ctas_for(n), kThreadsPerCta, 0, stream>>>(
        code_data.const_data_ptr(), scale_data.const_data_ptr<float>(),
        centre_data.const_data_ptr<scalar_t>(), blocks, n, out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace lazyzero::quant

TORCH_LIBRARY_IMPL(lazyzero, CUDA, m) {
  using namespace lazyzero::quant;
  m.impl("quantize_token_blocks", &quantize_token_blocks_cuda);
  m.impl("restore_token_blocks", &restore_token_blocks_cuda);
}
