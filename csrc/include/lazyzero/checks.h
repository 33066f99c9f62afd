// Argument checks shared by every lazyzero kernel: one wording for one mistake, whatever the op.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace lazyzero {

inline void check_dtype(const at::Tensor& t, at::ScalarType expected, const char* name) {
  TORCH_CHECK(t.scalar_type() == expected, name, " must have dtype ", expected, ", got ",
              t.scalar_type());
}

inline void check_numel(const at::Tensor& t, int64_t expected, const char* name) {
  TORCH_CHECK(t.numel() == expected, name, " must have ", expected, " elements, got ", t.numel());
}

inline void check_dim(const at::Tensor& t, int64_t expected, const char* name) {
  TORCH_CHECK(t.dim() == expected, name, " must be ", expected, "-D, got shape ", t.sizes());
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* a_name,
                              const char* b_name) {
  TORCH_CHECK(a.device() == b.device(), a_name, " and ", b_name,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace lazyzero
