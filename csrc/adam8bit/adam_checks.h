// Argument checks shared by the CPU and CUDA Adam kernels (host code): the ops can be called
// through torch.ops directly, so each kernel re-checks what the Python wrapper checks before it
// touches memory.
#pragma once

#include <ATen/core/Tensor.h>
#include <lazyzero/checks.h>

#include <cstdint>

#include "adam8bit/adam_common.h"

namespace lazyzero::optim {

// Elements per sum_squares chunk: fp32 sums within a chunk, float64 across chunks (the reference's
// SUM_SQUARES_CHUNK).
constexpr int64_t kSumSquaresChunk = 4096;

inline void check_block_size(int64_t block_size) {
  const bool power_of_two = block_size > 0 && (block_size & (block_size - 1)) == 0;
  TORCH_CHECK(power_of_two && block_size >= kMinBlockSize && block_size <= kMaxBlockSize,
              "block_size must be a power of two in [", kMinBlockSize, ", ", kMaxBlockSize,
              "], got ", block_size);
}

// A state, gradient or parameter tensor: given dtype, numel, contiguous, on param's device.
inline void check_operand(const at::Tensor& t, const at::Tensor& param, at::ScalarType dtype,
                          int64_t numel, const char* name) {
  check_dtype(t, dtype, name);
  check_numel(t, numel, name);
  check_contiguous(t, name);
  check_same_device(param, t, "param", name);
}

inline void check_param_and_grad(const at::Tensor& param, const at::Tensor& grad) {
  check_dtype(param, at::kFloat, "param");
  check_contiguous(param, "param");
  check_operand(grad, param, at::kFloat, param.numel(), "grad");
}

// Every operand of adam8bit_step_ (numel n, ceil(n / block_size) scales); returns the block count.
inline int64_t check_adam8bit_operands(const at::Tensor& param, const at::Tensor& grad,
                                       const at::Tensor& m_codes, const at::Tensor& m_scales,
                                       const at::Tensor& v_codes, const at::Tensor& v_scales,
                                       int64_t block_size) {
  check_block_size(block_size);
  check_param_and_grad(param, grad);
  const int64_t n = param.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  check_operand(m_codes, param, at::kByte, n, "m_codes");
  check_operand(v_codes, param, at::kByte, n, "v_codes");
  check_operand(m_scales, param, at::kFloat, blocks, "m_scales");
  check_operand(v_scales, param, at::kFloat, blocks, "v_scales");
  return blocks;
}

// Every operand of adam32_step_: fp32 moments of the parameter's size.
inline void check_adam32_operands(const at::Tensor& param, const at::Tensor& grad,
                                  const at::Tensor& m, const at::Tensor& v) {
  check_param_and_grad(param, grad);
  check_operand(m, param, at::kFloat, param.numel(), "m");
  check_operand(v, param, at::kFloat, param.numel(), "v");
}

}  // namespace lazyzero::optim
