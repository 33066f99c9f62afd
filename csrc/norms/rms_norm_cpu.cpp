// RMSNorm over rows on the CPU: the forward and its closed-form backward, one pass over each row's
// inputs per reduction, rows shared out with OpenMP (lazyzero/parallel.h). Rounding points are the
// reference's (lazyzero/ops/norms_reference.py); row sums are taken in double, so a row's mean can
// differ from the reference's fp32 sum in its last bit.
#include "norms/rms_norm_cpu.h"

#include <lazyzero/parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "norms/rms_norm_common.h"

namespace lazyzero::norms {
namespace {

// Rows per parallel task: enough elements per task that scheduling costs are noise.
int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

// Partial sums of the weight's gradient: a fixed count, so the sum's order is the same on any
// number of threads (the gradient is deterministic).
constexpr int64_t kWeightPartials = 64;

template <typename In>
float inverse_rms(const In* row, int64_t width, float eps) {
  double squares = 0.0;
  for (int64_t j = 0; j < width; ++j) {
    const float v = static_cast<float>(row[j]);
    squares += static_cast<double>(v * v);
  }
  const float mean = static_cast<float>(squares / static_cast<double>(width));
  return 1.0f / std::sqrt(mean + eps);
}

template <typename In, typename W>
void forward_rows(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& y) {
  using Out = typename Promoted<In, W>::type;
  const int64_t width = x.size(-1), rows = x.numel() / std::max<int64_t>(1, width);
  const In* xs = x.data_ptr<In>();
  const W* w = weight.data_ptr<W>();
  Out* ys = y.data_ptr<Out>();
  parallel_for_tasks(rows, rows_per_task(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const In* row = xs + r * width;
      const float rms_inverse = inverse_rms(row, width, eps);
      for (int64_t j = 0; j < width; ++j) {
        const float normalized = rounded_to<In>(static_cast<float>(row[j]) * rms_inverse);
        ys[r * width + j] = static_cast<Out>(static_cast<float>(w[j]) * normalized);
      }
    }
  });
}

// One row's input gradient, dx = r * (g - x̂ * mean(g * x̂)) with g = dy * w rounded to the output's
// dtype, and its term dy * x̂ of the weight's gradient added into `weight_sum` when given.
template <typename In, typename W, typename Out>
void backward_row(const In* row, const Out* grad, const W* w, int64_t width, float eps, In* grad_row,
                  float* weight_sum) {
  const float rms_inverse = inverse_rms(row, width, eps);
  double dot = 0.0;
  for (int64_t j = 0; j < width; ++j) {
    const float normalized = static_cast<float>(row[j]) * rms_inverse;
    if (weight_sum != nullptr) weight_sum[j] += static_cast<float>(grad[j]) * normalized;
    if (grad_row != nullptr) {
      const float scaled = rounded_to<Out>(static_cast<float>(grad[j]) * static_cast<float>(w[j]));
      dot += static_cast<double>(scaled * normalized);
    }
  }
  if (grad_row == nullptr) return;
  const float mean = static_cast<float>(dot / static_cast<double>(width));
  for (int64_t j = 0; j < width; ++j) {
    const float normalized = static_cast<float>(row[j]) * rms_inverse;
    const float scaled = rounded_to<Out>(static_cast<float>(grad[j]) * static_cast<float>(w[j]));
    grad_row[j] = static_cast<In>((scaled - normalized * mean) * rms_inverse);
  }
}

template <typename In, typename W>
void backward_rows(const at::Tensor& x, const at::Tensor& grad_y, const at::Tensor& weight, float eps,
                   at::Tensor* grad_x, at::Tensor* grad_weight) {
  using Out = typename Promoted<In, W>::type;
  const int64_t width = x.size(-1), rows = x.numel() / std::max<int64_t>(1, width);
  const int64_t partials = std::min(rows, kWeightPartials);
  std::vector<float> sums(grad_weight != nullptr ? partials * width : 0, 0.0f);
  const In* xs = x.data_ptr<In>();
  const Out* grads = grad_y.data_ptr<Out>();
  const W* w = weight.data_ptr<W>();
  In* dxs = grad_x != nullptr ? grad_x->data_ptr<In>() : nullptr;
  parallel_for_tasks(partials, 1, [&](int64_t begin, int64_t end) {
    for (int64_t part = begin; part < end; ++part) {
      float* weight_sum = sums.empty() ? nullptr : sums.data() + part * width;
      for (int64_t r = part * rows / partials; r < (part + 1) * rows / partials; ++r) {
        backward_row(xs + r * width, grads + r * width, w, width, eps, dxs ? dxs + r * width : nullptr,
                     weight_sum);
      }
    }
  });
  if (grad_weight == nullptr) return;
  W* dw = grad_weight->data_ptr<W>();
  for (int64_t j = 0; j < width; ++j) {
    float total = 0.0f;
    for (int64_t part = 0; part < partials; ++part) total += sums[part * width + j];
    dw[j] = static_cast<W>(total);
  }
}

}  // namespace

at::Tensor rms_norm_rows_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, double eps) {
  norm_width(x_in, weight_in);
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(at::result_type(weight, x)));
  dispatch_norm_types(x, weight, [&](auto in_tag, auto weight_tag) {
    forward_rows<decltype(in_tag), decltype(weight_tag)>(x, weight, static_cast<float>(eps), y);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_rows_backward_cpu(const at::Tensor& x_in, const at::Tensor& grad_in,
                                                              const at::Tensor& weight_in, double eps,
                                                              bool wants_x, bool wants_weight) {
  norm_width(x_in, weight_in);
  check_grad(x_in, grad_in, weight_in);
  const at::Tensor x = x_in.contiguous(), grad_y = grad_in.contiguous(), weight = weight_in.contiguous();
  at::Tensor grad_x = wants_x ? at::empty_like(x) : x.new_empty({0});
  at::Tensor grad_weight = wants_weight ? at::empty_like(weight) : weight.new_empty({0});
  if (!wants_x && !wants_weight) return {grad_x, grad_weight};
  if (x.numel() == 0) {
    grad_weight.zero_();
    return {grad_x, grad_weight};
  }
  dispatch_norm_types(x, weight, [&](auto in_tag, auto weight_tag) {
    backward_rows<decltype(in_tag), decltype(weight_tag)>(x, grad_y, weight, static_cast<float>(eps),
                                                          wants_x ? &grad_x : nullptr,
                                                          wants_weight ? &grad_weight : nullptr);
  });
  return {grad_x, grad_weight};
}

}  // namespace lazyzero::norms
