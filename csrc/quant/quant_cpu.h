// CPU kernels of the quant ops; registered in csrc/registration.cpp. Semantics: the schemas and
// references in lazyzero/ops/quant.py and lazyzero/ops/quant_reference.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace lazyzero::quant {

std::tuple<at::Tensor, at::Tensor> quantize_int8_cpu(const at::Tensor& x, int64_t block_size,
                                                     bool stochastic, int64_t seed);

std::tuple<at::Tensor, at::Tensor> quantize_int4_cpu(const at::Tensor& x, int64_t block_size,
                                                     bool stochastic, int64_t seed);

void quantize_int8_into_cpu(const at::Tensor& x, int64_t block_size, bool stochastic,
                            int64_t seed, const at::Tensor& codes, const at::Tensor& scales);

at::Tensor dequantize_int8_cpu(const at::Tensor& codes, const at::Tensor& scales,
                               int64_t block_size, at::ScalarType out_dtype);

void dequantize_int8_into_cpu(const at::Tensor& codes, const at::Tensor& scales,
                              int64_t block_size, const at::Tensor& out);

at::Tensor dequantize_int4_cpu(const at::Tensor& packed, const at::Tensor& scales, int64_t numel,
                               int64_t block_size, at::ScalarType out_dtype);

at::Tensor dequantize_sum_int8_cpu(const at::Tensor& codes, const at::Tensor& scales,
                                   int64_t block_size, double alpha);

void dequantize_sum_int8_into_cpu(const at::Tensor& codes, const at::Tensor& scales,
                                  int64_t block_size, double alpha, const at::Tensor& out);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_int8_outliers_cpu(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_int4_outliers_cpu(
    const at::Tensor& x, int64_t block_size, bool stochastic, int64_t seed);

void restore_block_outliers_cpu(const at::Tensor& out, const at::Tensor& values,
                                const at::Tensor& index, int64_t block_size);

// csrc/quant/token_blocks_cpu.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_token_blocks_cpu(
    const at::Tensor& x, int64_t tokens, int64_t channels, int64_t bits, int64_t block_size,
    bool stochastic, int64_t seed);

at::Tensor restore_token_blocks_cpu(const at::Tensor& codes, const at::Tensor& scales,
                                    const at::Tensor& centres, int64_t tokens, int64_t channels,
                                    int64_t bits, int64_t block_size);

}  // namespace lazyzero::quant
