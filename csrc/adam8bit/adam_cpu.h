// CPU kernels of the fused Adam ops; registered in csrc/registration.cpp. Semantics: the schemas
// and references in lazyzero/ops/adam8bit.py and lazyzero/ops/adam8bit_reference.py.
#pragma once

#include <ATen/core/Tensor.h>

namespace lazyzero::optim {

void adam8bit_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m_codes,
                       const at::Tensor& m_scales, const at::Tensor& v_codes,
                       const at::Tensor& v_scales, int64_t block_size, double beta1, double beta2,
                       double eps, double step_size, double inv_sqrt_bias_correction2,
                       double decay_factor, double l2_weight_decay, double grad_scale);

void adam32_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
                     const at::Tensor& v, double beta1, double beta2, double eps, double step_size,
                     double inv_sqrt_bias_correction2, double decay_factor,
                     double l2_weight_decay, double grad_scale);

at::Tensor sum_squares_cpu(at::TensorList tensors);

}  // namespace lazyzero::optim
