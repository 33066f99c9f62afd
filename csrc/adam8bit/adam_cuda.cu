// CUDA kernels of the fused Adam steps and of the gradient sum of squares
// (spec: lazyzero/ops/adam8bit_reference.py; element math: adam8bit/adam_common.h).
//
// 8-bit step: each quantization block belongs to a group of consecutive whole warps of one CTA of
// 256 threads (block_size / elements-per-thread threads; several blocks per CTA below 256). A
// thread updates its elements, keeps their new m and s in registers, the group reduces both absmax
// values (warp shuffles, then shared memory), and the same thread requantizes its elements. So the
// new moments never reach memory in fp32, and the old scales are read before any thread of the
// group writes the new ones. All fp32 arithmetic goes through adam_common.h, whose explicit
// round-to-nearest intrinsics keep the results bit-identical to the reference and the CPU kernels.
//
// Sum of squares: one CTA per chunk of 4096 elements writes the chunk's fp32 sum; a second kernel
// adds the chunk sums in fp64. Both reductions run in a fixed order, so unlike fp64 atomics the
// result is the same on every run: a gradient norm that decides clipping stays reproducible.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <lazyzero/checks.h>
#include <lazyzero/dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "adam8bit/adam_checks.h"
#include "adam8bit/adam_common.h"
#include "quant/quant_common.h"

namespace lazyzero::optim {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerCta = 256;
constexpr int kWarpsPerCta = kThreadsPerCta / kWarpSize;
// Grid-stride loops cover any size; more CTAs than this only adds scheduling overhead.
constexpr int64_t kMaxCtas = 4096;
// The spec's fp32 accumulation unit: one CTA sums one chunk, kThreadsPerCta lanes of 16 elements.

__device__ __forceinline__ uint32_t warp_max(uint32_t value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value += __shfl_xor_sync(0xffffffffu, value, offset);
  }
  return value;
}

// Sum of `value` over the CTA, in a fixed order; the result is valid in thread 0 only.
template <typename T>
__device__ T cta_sum(T value) {
  __shared__ T warp_sums[kWarpsPerCta];
  value = warp_sum(value);
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = value;
  __syncthreads();
  T total = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarpsPerCta; ++w) total += warp_sums[w];
  }
  return total;
}

// One quantized moment: uint8 codes [n] and fp32 scales [ceil(n / block_size)].
struct QuantizedMoment {
  uint8_t* codes;
  float* scales;
};

struct Adam8bitBuffers {
  float* param;
  const float* grad;
  QuantizedMoment m;
  QuantizedMoment s;  // sqrt of the second moment
  int64_t n;
  int64_t nblocks;
  int block_size;
};

// The quantization block a thread works on and the thread's place in it.
struct BlockGroup {
  int64_t block;
  int64_t start;  // first element of the block
  int64_t len;    // elements of the block (0 for a group past the last block)
  int rank;       // thread's index within the group
  int threads;    // threads of the group: whole warps
  int first_warp;  // group's first warp within the CTA
};

template <int kElemsPerThread>
__device__ BlockGroup block_group(const Adam8bitBuffers& a) {
  BlockGroup g;
  g.threads = a.block_size / kElemsPerThread;
  const int group_in_cta = threadIdx.x / g.threads;
  g.rank = threadIdx.x % g.threads;
  g.first_warp = group_in_cta * (g.threads / kWarpSize);
  g.block = blockIdx.x * static_cast<int64_t>(kThreadsPerCta / g.threads) + group_in_cta;
  g.start = g.block * a.block_size;
  const int64_t remaining = a.n - g.start;
  g.len = g.block >= a.nblocks ? 0 : (remaining < a.block_size ? remaining : a.block_size);
  return g;
}

// Max of the two abs_bits values over the group's warps. Every thread of the CTA must call it:
// it synchronizes the CTA, which also orders the group's reads of the old scales before the writes
// of the new ones.
__device__ uint2 group_absmax_bits(uint32_t m_bits, uint32_t s_bits, const BlockGroup& g) {
  __shared__ uint32_t m_warp_max[kWarpsPerCta];
  __shared__ uint32_t s_warp_max[kWarpsPerCta];
  m_bits = warp_max(m_bits);
  s_bits = warp_max(s_bits);
  if (threadIdx.x % kWarpSize == 0) {
    m_warp_max[threadIdx.x / kWarpSize] = m_bits;
    s_warp_max[threadIdx.x / kWarpSize] = s_bits;
  }
  __syncthreads();
  for (int w = g.first_warp; w < g.first_warp + g.threads / kWarpSize; ++w) {
    m_bits = max(m_bits, m_warp_max[w]);
    s_bits = max(s_bits, s_warp_max[w]);
  }
  return make_uint2(m_bits, s_bits);
}

// Thread's elements are start + rank + e * threads (e < kElemsPerThread): coalesced accesses.
template <int kElemsPerThread>
__global__ void __launch_bounds__(kThreadsPerCta)
    adam8bit_step_kernel(Adam8bitBuffers a, AdamScalars scalars) {
  const BlockGroup g = block_group<kElemsPerThread>(a);
  const float old_m_scale = g.len > 0 ? a.m.scales[g.block] : 0.0f;
  const float old_s_scale = g.len > 0 ? a.s.scales[g.block] : 0.0f;
  float new_m[kElemsPerThread];
  float new_s[kElemsPerThread];
  uint32_t m_bits = 0;
  uint32_t s_bits = 0;
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) {
    const int64_t j = g.rank + e * g.threads;
    new_m[e] = 0.0f;
    new_s[e] = 0.0f;
    if (j < g.len) {
      const int64_t i = g.start + j;
      const float s_hat = decode_s(a.s.codes[i], old_s_scale);
      const float m_hat = decode_m(a.m.codes[i], old_m_scale);
      const AdamElement r =
          adam_element_step(a.param[i], a.grad[i], m_hat, mul_rn(s_hat, s_hat), scalars);
      a.param[i] = r.param;
      new_m[e] = r.m;
      new_s[e] = r.s;
      m_bits = max(m_bits, abs_bits(r.m));
      s_bits = max(s_bits, abs_bits(r.s));
    }
  }
  const uint2 absmax_bits = group_absmax_bits(m_bits, s_bits, g);
  const float m_scale = block_scale_from_absmax_bits(absmax_bits.x);
  const float s_scale = block_scale_from_absmax_bits(absmax_bits.y);
  if (g.rank == 0 && g.len > 0) {
    a.m.scales[g.block] = m_scale;
    a.s.scales[g.block] = s_scale;
  }
  const float m_inv = inverse_scale(m_scale);
  const float s_inv = inverse_scale(s_scale);
#pragma unroll
  for (int e = 0; e < kElemsPerThread; ++e) {
    const int64_t j = g.rank + e * g.threads;
    if (j < g.len) {
      a.m.codes[g.start + j] = encode_m(new_m[e], m_inv);
      a.s.codes[g.start + j] = encode_s(new_s[e], s_inv);
    }
  }
}

__global__ void adam32_step_kernel(float* param, const float* grad, float* m, float* v, int64_t n,
                                   AdamScalars scalars) {
  const int64_t stride = gridDim.x * static_cast<int64_t>(blockDim.x);
  const int64_t first = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  for (int64_t i = first; i < n; i += stride) {
    const AdamElement r = adam_element_step(param[i], grad[i], m[i], v[i], scalars);
    param[i] = r.param;
    m[i] = r.m;
    v[i] = r.v;
  }
}

// chunk_sums[c] = fp32 sum of x*x over elements [c * 4096, (c + 1) * 4096) of x.
template <typename T>
__global__ void __launch_bounds__(kThreadsPerCta)
    chunk_sum_squares_kernel(const T* x, int64_t n, float* chunk_sums) {
  const int64_t start = blockIdx.x * kSumSquaresChunk;
  const int64_t len = n - start < kSumSquaresChunk ? n - start : kSumSquaresChunk;
  float lane_sum = 0.0f;
  for (int64_t j = threadIdx.x; j < len; j += kThreadsPerCta) {
    const float value = static_cast<float>(x[start + j]);
    lane_sum = add_rn(lane_sum, mul_rn(value, value));
  }
  const float chunk_sum = cta_sum(lane_sum);
  if (threadIdx.x == 0) chunk_sums[blockIdx.x] = chunk_sum;
}

__global__ void __launch_bounds__(kThreadsPerCta)
    sum_chunks_kernel(const float* chunk_sums, int64_t count, double* out) {
  double lane_sum = 0.0;
  for (int64_t c = threadIdx.x; c < count; c += kThreadsPerCta) {
    lane_sum += static_cast<double>(chunk_sums[c]);
  }
  const double total = cta_sum(lane_sum);
  if (threadIdx.x == 0) *out = total;
}


template <int kElemsPerThread>
void launch_adam8bit_step(const Adam8bitBuffers& buffers, const AdamScalars& scalars) {
  const int64_t blocks_per_cta = kThreadsPerCta / (buffers.block_size / kElemsPerThread);
  const int64_t ctas = (buffers.nblocks + blocks_per_cta - 1) / blocks_per_cta;
  TORCH_CHECK(ctas <= std::numeric_limits<int32_t>::max(), "adam8bit_step_: ", buffers.n,
              " elements need more CUDA blocks than a grid holds");
  adam8bit_step_kernel<kElemsPerThread>
      <<<ctas, kThreadsPerCta, 0, c10::cuda::getCurrentCUDAStream()>>>(buffers, scalars);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void adam8bit_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m_codes,
                        const at::Tensor& m_scales, const at::Tensor& v_codes,
                        const at::Tensor& v_scales, int64_t block_size, double beta1, double beta2,
                        double eps, double step_size, double inv_sqrt_bias_correction2,
                        double decay_factor, double l2_weight_decay, double grad_scale) {
  const int64_t nblocks =
      check_adam8bit_operands(param, grad, m_codes, m_scales, v_codes, v_scales, block_size);
  TORCH_CHECK(param.is_cuda(), "param must be a CUDA tensor, got ", param.device());
  const int64_t n = param.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  const QuantizedMoment m{m_codes.mutable_data_ptr<uint8_t>(), m_scales.mutable_data_ptr<float>()};
  const QuantizedMoment s{v_codes.mutable_data_ptr<uint8_t>(), v_scales.mutable_data_ptr<float>()};
  const Adam8bitBuffers buffers{param.mutable_data_ptr<float>(), grad.const_data_ptr<float>(), m, s,
                                n, nblocks, static_cast<int>(block_size)};
  const AdamScalars scalars =
      make_adam_scalars(beta1, beta2, eps, step_size, inv_sqrt_bias_correction2, decay_factor,
                        l2_weight_decay, grad_scale);
  // Up to 256 elements a thread takes one; above, 256 threads share the block.
  switch (std::max<int64_t>(1, block_size / kThreadsPerCta)) {
    case 1: return launch_adam8bit_step<1>(buffers, scalars);
    case 2: return launch_adam8bit_step<2>(buffers, scalars);
    case 4: return launch_adam8bit_step<4>(buffers, scalars);
    case 8: return launch_adam8bit_step<8>(buffers, scalars);
    default: return launch_adam8bit_step<16>(buffers, scalars);
  }
}

void adam32_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
                      const at::Tensor& v, double beta1, double beta2, double eps, double step_size,
                      double inv_sqrt_bias_correction2, double decay_factor, double l2_weight_decay,
                      double grad_scale) {
  check_adam32_operands(param, grad, m, v);
  TORCH_CHECK(param.is_cuda(), "param must be a CUDA tensor, got ", param.device());
  const int64_t n = param.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  const AdamScalars scalars =
      make_adam_scalars(beta1, beta2, eps, step_size, inv_sqrt_bias_correction2, decay_factor,
                        l2_weight_decay, grad_scale);
  const int64_t ctas = std::clamp<int64_t>((n + kThreadsPerCta - 1) / kThreadsPerCta, 1, kMaxCtas);
  adam32_step_kernel<<<ctas, kThreadsPerCta, 0, c10::cuda::getCurrentCUDAStream()>>>(
      param.mutable_data_ptr<float>(), grad.const_data_ptr<float>(), m.mutable_data_ptr<float>(),
      v.mutable_data_ptr<float>(), n, scalars);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t num_chunks(const at::Tensor& t) {
  return (t.numel() + kSumSquaresChunk - 1) / kSumSquaresChunk;
}

// Writes the chunk sums of every tensor, one after the other, from `chunk_sums` on.
void write_chunk_sums(at::TensorList tensors, float* chunk_sums, cudaStream_t stream) {
  for (const at::Tensor& tensor : tensors) {
    const int64_t chunks = num_chunks(tensor);
    if (chunks == 0) continue;
    const at::Tensor x = tensor.contiguous();
    LZ_DISPATCH_FLOAT_TYPES(x.scalar_type(), "lazyzero::sum_squares", [&] {
      chunk_sum_squares_kernel<scalar_t><<<chunks, kThreadsPerCta, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), x.numel(), chunk_sums);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    chunk_sums += chunks;
  }
}

at::Tensor sum_squares_cuda(at::TensorList tensors) {
  TORCH_CHECK(!tensors.empty(), "sum_squares: the CUDA kernel needs at least one tensor");
  int64_t total_chunks = 0;
  for (const at::Tensor& tensor : tensors) {
    quant::check_float_dtype(tensor.scalar_type(), "sum_squares tensors");
    check_same_device(tensors[0], tensor, "tensors[0]", "every tensor");
    total_chunks += num_chunks(tensor);
  }
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  const at::TensorOptions double_options = tensors[0].options().dtype(at::kDouble);
  if (total_chunks == 0) return at::zeros({}, double_options);
  TORCH_CHECK(total_chunks <= std::numeric_limits<int32_t>::max(),
              "sum_squares: too many elements for one grid");
  at::Tensor out = at::empty({}, double_options);
  const at::Tensor chunk_sums = at::empty({total_chunks}, double_options.dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  write_chunk_sums(tensors, chunk_sums.mutable_data_ptr<float>(), stream);
  sum_chunks_kernel<<<1, kThreadsPerCta, 0, stream>>>(
      chunk_sums.const_data_ptr<float>(), total_chunks, out.mutable_data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace lazyzero::optim

TORCH_LIBRARY_IMPL(lazyzero, CUDA, m) {
  using namespace lazyzero::optim;
  m.impl("adam8bit_step_", &adam8bit_step_cuda);
  m.impl("adam32_step_", &adam32_step_cuda);
  m.impl("sum_squares", &sum_squares_cuda);
}
