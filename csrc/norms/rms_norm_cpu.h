// RMSNorm over rows on the CPU (OpenMP over rows); schemas in lazyzero/ops/norms.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace lazyzero::norms {

at::Tensor rms_norm_rows_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> rms_norm_rows_backward_cpu(const at::Tensor& x, const at::Tensor& grad_y,
                                                              const at::Tensor& weight, double eps, bool wants_x,
                                                              bool wants_weight);

}  // namespace lazyzero::norms
