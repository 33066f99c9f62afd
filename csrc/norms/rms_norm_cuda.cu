// RMSNorm over rows on CUDA: the forward in one launch; the closed-form backward in one launch, plus
// one for the weight's gradient (each block sums its rows' terms into a row of fp32 partials, which
// the second launch adds up in block order: deterministic). A block of kThreads threads handles one
// row at a time, rows strided over the grid; its row is read once per reduction and once to write,
// from L1/L2 after the first pass. Rounding points are the reference's
// (lazyzero/ops/norms_reference.py); row sums are trees of fp32 additions.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "norms/rms_norm_common.h"

namespace lazyzero::norms {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Resident blocks per SM asked for: the forward's grid, and the backward's (fewer, as each block
// keeps a row of partial sums of the weight's gradient).
constexpr int kForwardBlocksPerSm = 8;
constexpr int kBackwardBlocksPerSm = 4;

// The block's total of `value`, the same in every thread (every thread adds the warps' sums in the
// same order). `shared` holds kWarps floats and may be reused by the next call.
__device__ float block_sum(float value, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) value = __fadd_rn(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();  // the previous call's readers are done with `shared`
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = value;
  __syncthreads();
  float total = 0.0f;
  for (int warp = 0; warp < kWarps; ++warp) total = __fadd_rn(total, shared[warp]);
  return total;
}

template <typename In>
__device__ float inverse_rms(const In* row, int64_t width, float eps, float* shared) {
  float squares = 0.0f;
  for (int64_t j = threadIdx.x; j < width; j += kThreads) {
    const float v = static_cast<float>(row[j]);
    squares = __fadd_rn(squares, __fmul_rn(v, v));
  }
  const float mean = __fdiv_rn(block_sum(squares, shared), static_cast<float>(width));
  return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(mean, eps)));
}

template <typename In, typename W, typename Out>
__global__ void rms_norm_rows_kernel(const In* x, const W* w, Out* y, int64_t rows, int64_t width, float eps) {
  __shared__ float shared[kWarps];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const In* row = x + r * width;
    const float rms_inverse = inverse_rms(row, width, eps, shared);
    for (int64_t j = threadIdx.x; j < width; j += kThreads) {
      const float normalized = rounded_to<In>(__fmul_rn(static_cast<float>(row[j]), rms_inverse));
      y[r * width + j] = static_cast<Out>(__fmul_rn(static_cast<float>(w[j]), normalized));
    }
  }
}

// dx = r * (g - x̂ * mean(g * x̂)), g = dy * w rounded to Out (when dx is given), and block b's
// partial sum of dy * x̂ over its rows in partials[b] (when partials is given).
template <typename In, typename W, typename Out>
__global__ void rms_norm_rows_backward_kernel(const In* x, const Out* dy, const W* w, In* dx, float* partials,
                                              int64_t rows, int64_t width, float eps) {
  __shared__ float shared[kWarps];
  float* partial = partials != nullptr ? partials + blockIdx.x * width : nullptr;
  if (partial != nullptr) {
    for (int64_t j = threadIdx.x; j < width; j += kThreads) partial[j] = 0.0f;  // this thread's columns only
  }
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const In* row = x + r * width;
    const Out* grad = dy + r * width;
    const float rms_inverse = inverse_rms(row, width, eps, shared);
    float mean = 0.0f;
    if (dx != nullptr) {
      float dot = 0.0f;
      for (int64_t j = threadIdx.x; j < width; j += kThreads) {
        const float scaled = rounded_to<Out>(__fmul_rn(static_cast<float>(grad[j]), static_cast<float>(w[j])));
        dot = __fadd_rn(dot, __fmul_rn(scaled, __fmul_rn(static_cast<float>(row[j]), rms_inverse)));
      }
      mean = __fdiv_rn(block_sum(dot, shared), static_cast<float>(width));
    }
    for (int64_t j = threadIdx.x; j < width; j += kThreads) {
      const float normalized = __fmul_rn(static_cast<float>(row[j]), rms_inverse);
      if (partial != nullptr) partial[j] = __fadd_rn(partial[j], __fmul_rn(static_cast<float>(grad[j]), normalized));
      if (dx != nullptr) {
        const float scaled = rounded_to<Out>(__fmul_rn(static_cast<float>(grad[j]), static_cast<float>(w[j])));
        dx[r * width + j] = static_cast<In>(__fmul_rn(__fsub_rn(scaled, __fmul_rn(normalized, mean)), rms_inverse));
      }
    }
  }
}

// dw[j] = the sum of partials[b][j] over b in order, in W.
template <typename W>
__global__ void sum_partials_kernel(const float* partials, int64_t count, int64_t width, W* dw) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < width;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = 0.0f;
    for (int64_t b = 0; b < count; ++b) total = __fadd_rn(total, partials[b * width + j]);
    dw[j] = static_cast<W>(total);
  }
}

int64_t grid_for(int64_t rows, int blocks_per_sm) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return std::min<int64_t>(rows, static_cast<int64_t>(sms) * blocks_per_sm);
}

}  // namespace

at::Tensor rms_norm_rows_cuda(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  const int64_t width = norm_width(x_in, weight_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::result_type(weight, x)));
  const int64_t rows = width == 0 ? 0 : x.numel() / width;
  if (rows == 0) return y;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_norm_types(x, weight, [&](auto in_tag, auto weight_tag) {
    using In = decltype(in_tag);
    using W = decltype(weight_tag);
    using Out = typename Promoted<In, W>::type;
    rms_norm_rows_kernel<In, W, Out><<<grid_for(rows, kForwardBlocksPerSm), kThreads, 0, stream>>>(
        x.data_ptr<In>(), weight.data_ptr<W>(), y.data_ptr<Out>(), rows, width, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_rows_backward_cuda(const at::Tensor& x_in, const at::Tensor& grad_in,
                                                               const at::Tensor& weight_in, double eps,
                                                               bool wants_x, bool wants_weight) {
  const int64_t width = norm_width(x_in, weight_in);
  check_grad(x_in, grad_in, weight_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), grad_y = grad_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor grad_x = wants_x ? at::empty_like(x) : x.new_empty({0});
  at::Tensor grad_weight = wants_weight ? at::empty_like(weight) : weight.new_empty({0});
  const int64_t rows = width == 0 ? 0 : x.numel() / width;
  if (!wants_x && !wants_weight) return {grad_x, grad_weight};
  if (rows == 0) {
    grad_weight.zero_();
    return {grad_x, grad_weight};
  }
  const int64_t grid = grid_for(rows, kBackwardBlocksPerSm);
  at::Tensor partials = wants_weight ? at::empty({grid, width}, x.options().dtype(at::kFloat)) : at::Tensor();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_norm_types(x, weight, [&](auto in_tag, auto weight_tag) {
    using In = decltype(in_tag);
    using W = decltype(weight_tag);
    using Out = typename Promoted<In, W>::type;
    rms_norm_rows_backward_kernel<In, W, Out><<<grid, kThreads, 0, stream>>>(
        x.data_ptr<In>(), grad_y.data_ptr<Out>(), weight.data_ptr<W>(), wants_x ? grad_x.data_ptr<In>() : nullptr,
        wants_weight ? partials.data_ptr<float>() : nullptr, rows, width, static_cast<float>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (wants_weight) {
      const int64_t blocks = std::min<int64_t>((width + kThreads - 1) / kThreads, 1024);
      sum_partials_kernel<W><<<blocks, kThreads, 0, stream>>>(partials.data_ptr<float>(), grid, width,
                                                              grad_weight.data_ptr<W>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {grad_x, grad_weight};
}

}  // namespace lazyzero::norms

TORCH_LIBRARY_IMPL(lazyzero, CUDA, m) {
  using namespace lazyzero::norms;
  m.impl("rms_norm_rows", &rms_norm_rows_cuda);
  m.impl("rms_norm_rows_backward", &rms_norm_rows_backward_cuda);
}
