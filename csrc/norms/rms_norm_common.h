// What the CPU and CUDA RMSNorm kernels share: dtype dispatch, the output dtype, argument checks.
//
// The rows are x's last dimension: y = weight * to_x_dtype(x * r), r = 1 / sqrt(mean(x^2) + eps), in
// fp32 inside, as transformers' LlamaRMSNorm computes it (lazyzero/ops/norms_reference.py).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace lazyzero::norms {

// The dtype torch gives weight * x_rounded: the same type, else float (bf16 with fp16 gives float too).
template <typename A, typename B>
struct Promoted {
  using type = float;
};
template <typename A>
struct Promoted<A, A> {
  using type = A;
};

// Calls `body(T{})` with T the C++ type of `dtype` (float, c10::BFloat16 or c10::Half).
template <typename Body>
void dispatch_float(at::ScalarType dtype, const char* what, Body&& body) {
  switch (dtype) {
    case at::kFloat: return body(float{});
    case at::kBFloat16: return body(c10::BFloat16{});
    case at::kHalf: return body(c10::Half{});
    default: TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", dtype);
  }
}

// Calls `body(In{}, W{})` for x's and weight's C++ types.
template <typename Body>
void dispatch_norm_types(const at::Tensor& x, const at::Tensor& weight, Body&& body) {
  dispatch_float(x.scalar_type(), "x", [&](auto in_tag) {
    dispatch_float(weight.scalar_type(), "weight", [&](auto weight_tag) { body(in_tag, weight_tag); });
  });
}

// Rounds v to T's precision and back: the rounding torch applies when it stores a T.
template <typename T>
C10_HOST_DEVICE inline float rounded_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

inline int64_t norm_width(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1, "x must have at least one dimension");
  const int64_t width = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.numel() == width, "weight must be [", width, "], got ",
              weight.sizes());
  TORCH_CHECK(weight.device() == x.device(), "weight and x are on different devices");
  return width;
}

// grad_y has x's shape and the output's dtype, as autograd gives it.
inline void check_grad(const at::Tensor& x, const at::Tensor& grad_y, const at::Tensor& weight) {
  TORCH_CHECK(grad_y.sizes() == x.sizes(), "grad_y must have x's shape ", x.sizes(), ", got ", grad_y.sizes());
  TORCH_CHECK(grad_y.scalar_type() == at::result_type(weight, x), "grad_y must be ",
              at::result_type(weight, x), " (the output's dtype), got ", grad_y.scalar_type());
  TORCH_CHECK(grad_y.device() == x.device(), "grad_y and x are on different devices");
}

}  // namespace lazyzero::norms
