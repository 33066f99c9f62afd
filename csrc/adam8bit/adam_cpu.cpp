// CPU kernels of the fused Adam steps and of the gradient sum of squares
// (spec: lazyzero/ops/adam8bit_reference.py; element math: csrc/adam8bit/adam_common.h).
//
// The 8-bit step makes one pass over memory: per quantization block it decodes the old codes,
// updates the parameters and keeps the new m and s = sqrt(v) in stack buffers (in L1 for blocks of
// up to 1024 elements, in L2 above), then encodes them from there. That moves 16 bytes per
// parameter (fp32 param read + write, fp32 grad, two uint8 codes read + write) against 28 for an
// fp32-state Adam, but costs about four times its vector arithmetic (decoding, encoding, absmax):
// ~1 ns per parameter on one Zen 4 core. It therefore beats an fp32 Adam, which is memory-bound,
// wherever a core has less than ~28 GB/s of memory bandwidth to itself (servers with many cores per
// memory channel), and trails it on a lone core with more (measured: 0.95 vs 0.72 ns at 39 GB/s).
// Inner loops are counted loops over restrict pointers with branch-free bodies, so gcc -O3
// vectorizes them (check with -fopt-info-vec); work is split over blocks with OpenMP
// (lazyzero/parallel.h).
#include "adam8bit/adam_cpu.h"

#include <ATen/ops/scalar_tensor.h>
#include <lazyzero/checks.h>
#include <lazyzero/dispatch.h>
#include <lazyzero/parallel.h>

#include <algorithm>
#include <vector>

#include "adam8bit/adam_checks.h"
#include "adam8bit/adam_common.h"

namespace lazyzero::optim {
namespace {

// Elements per parallel task: large enough that OpenMP scheduling costs are noise, small enough
// that dynamic scheduling balances a core that is descheduled for a while.
constexpr int64_t kElementsPerTask = 1 << 16;
// Independent fp32 partial sums per chunk: several vector registers' worth, so consecutive adds do
// not wait on each other's latency.
constexpr int kSumLanes = 64;

struct Adam8bitBuffers {
  float* __restrict param;
  const float* __restrict grad;
  uint8_t* __restrict m_codes;
  float* __restrict m_scales;
  uint8_t* __restrict v_codes;
  float* __restrict v_scales;
};

// max abs_bits() of a block's new m and s.
struct BlockAbsmax {
  uint32_t m;
  uint32_t s;
};

// Updates `len` parameters of one block from its old codes; writes the new m and s to the buffers
// and returns their absmax bit patterns.
BlockAbsmax update_block(const Adam8bitBuffers& a, int64_t start, int64_t len, float m_scale,
                         float s_scale, AdamScalars k, float* __restrict m_new,
                         float* __restrict s_new) {
  float* __restrict param = a.param + start;
  const float* __restrict grad = a.grad + start;
  const uint8_t* __restrict m_codes = a.m_codes + start;
  const uint8_t* __restrict v_codes = a.v_codes + start;
  uint32_t m_max = 0;
  uint32_t s_max = 0;
  for (int64_t i = 0; i < len; ++i) {
    const float m_hat = decode_m(m_codes[i], m_scale);
    const float s_hat = decode_s(v_codes[i], s_scale);
    const AdamElement e = adam_element_step(param[i], grad[i], m_hat, mul_rn(s_hat, s_hat), k);
    param[i] = e.param;
    m_new[i] = e.m;
    s_new[i] = e.s;
    const uint32_t m_bits = abs_bits(e.m);
    const uint32_t s_bits = abs_bits(e.s);
    m_max = m_bits > m_max ? m_bits : m_max;
    s_max = s_bits > s_max ? s_bits : s_max;
  }
  return BlockAbsmax{m_max, s_max};
}

// One loop for both states: it shares the loop overhead and keeps more independent work in flight.
void encode_block(const float* __restrict m, const float* __restrict s, int64_t len,
                  float m_inv_scale, float s_inv_scale, uint8_t* __restrict m_codes,
                  uint8_t* __restrict v_codes) {
  for (int64_t i = 0; i < len; ++i) {
    m_codes[i] = encode_m(m[i], m_inv_scale);
    v_codes[i] = encode_s(s[i], s_inv_scale);
  }
}

void step_8bit_blocks(const Adam8bitBuffers& a, int64_t n, int64_t block_size,
                      const AdamScalars& k, int64_t first_block, int64_t end_block) {
  alignas(64) float m_new[kMaxBlockSize];
  alignas(64) float s_new[kMaxBlockSize];
  for (int64_t b = first_block; b < end_block; ++b) {
    const int64_t start = b * block_size;
    const int64_t len = std::min(block_size, n - start);
    const BlockAbsmax absmax =
        update_block(a, start, len, a.m_scales[b], a.v_scales[b], k, m_new, s_new);
    const float m_scale = block_scale_from_absmax_bits(absmax.m);
    const float s_scale = block_scale_from_absmax_bits(absmax.s);
    encode_block(m_new, s_new, len, inverse_scale(m_scale), inverse_scale(s_scale),
                 a.m_codes + start, a.v_codes + start);
    a.m_scales[b] = m_scale;
    a.v_scales[b] = s_scale;
  }
}

void step_32bit_range(float* __restrict param, const float* __restrict grad,
                      float* __restrict m, float* __restrict v, AdamScalars k,
                      int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const AdamElement e = adam_element_step(param[i], grad[i], m[i], v[i], k);
    param[i] = e.param;
    m[i] = e.m;
    v[i] = e.v;
  }
}

// Sum of x * x over one chunk in fp32: kSumLanes interleaved partial sums, then a pairwise tree.
template <typename T>
float chunk_sum_squares(const T* __restrict x, int64_t len) {
  float lanes[kSumLanes] = {};
  const int64_t whole = len - len % kSumLanes;
  for (int64_t i = 0; i < whole; i += kSumLanes) {
    for (int j = 0; j < kSumLanes; ++j) {
      const float value = static_cast<float>(x[i + j]);
      lanes[j] = lanes[j] + value * value;
    }
  }
  for (int64_t i = whole; i < len; ++i) {
    const float value = static_cast<float>(x[i]);
    lanes[i - whole] = lanes[i - whole] + value * value;
  }
  for (int width = kSumLanes / 2; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) lanes[j] = lanes[j] + lanes[j + width];
  }
  return lanes[0];
}

// Chunk sums of one contiguous tensor into sums[0 .. ceil(numel / chunk)).
void tensor_chunk_sums(const at::Tensor& tensor, int64_t first_chunk, int64_t end_chunk,
                       double* sums) {
  const int64_t n = tensor.numel();
  LZ_DISPATCH_FLOAT_TYPES(tensor.scalar_type(), "lazyzero::sum_squares", [&] {
    const scalar_t* data = tensor.const_data_ptr<scalar_t>();
    for (int64_t c = first_chunk; c < end_chunk; ++c) {
      const int64_t start = c * kSumSquaresChunk;
      sums[c] = chunk_sum_squares(data + start, std::min(kSumSquaresChunk, n - start));
    }
  });
}

// Chunk sums of global chunks [begin, end) of `inputs`, whose chunks start at first_chunk[t].
void sum_chunks_of_tensors(const std::vector<at::Tensor>& inputs,
                           const std::vector<int64_t>& first_chunk, int64_t begin, int64_t end,
                           double* chunk_sums) {
  // The last tensor whose first chunk is <= begin: the one holding chunk `begin`.
  size_t t = std::upper_bound(first_chunk.begin(), first_chunk.end(), begin) - first_chunk.begin();
  --t;
  for (int64_t c = begin; c < end; ++t) {
    const int64_t stop = std::min(end, first_chunk[t + 1]);  // c == stop for an empty tensor
    tensor_chunk_sums(inputs[t], c - first_chunk[t], stop - first_chunk[t],
                      chunk_sums + first_chunk[t]);
    c = stop;
  }
}

}  // namespace

void adam8bit_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m_codes,
                       const at::Tensor& m_scales, const at::Tensor& v_codes,
                       const at::Tensor& v_scales, int64_t block_size, double beta1, double beta2,
                       double eps, double step_size, double inv_sqrt_bias_correction2,
                       double decay_factor, double l2_weight_decay, double grad_scale) {
  const int64_t blocks =
      check_adam8bit_operands(param, grad, m_codes, m_scales, v_codes, v_scales, block_size);
  const int64_t n = param.numel();
  const AdamScalars k = make_adam_scalars(beta1, beta2, eps, step_size, inv_sqrt_bias_correction2,
                                          decay_factor, l2_weight_decay, grad_scale);
  const Adam8bitBuffers buffers{param.mutable_data_ptr<float>(), grad.const_data_ptr<float>(),
                                m_codes.mutable_data_ptr<uint8_t>(),
                                m_scales.mutable_data_ptr<float>(),
                                v_codes.mutable_data_ptr<uint8_t>(),
                                v_scales.mutable_data_ptr<float>()};
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / block_size);
  parallel_for_tasks(blocks, grain, [&](int64_t begin, int64_t end) {
    step_8bit_blocks(buffers, n, block_size, k, begin, end);
  });
}

void adam32_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& m,
                     const at::Tensor& v, double beta1, double beta2, double eps, double step_size,
                     double inv_sqrt_bias_correction2, double decay_factor,
                     double l2_weight_decay, double grad_scale) {
  check_adam32_operands(param, grad, m, v);
  const AdamScalars k = make_adam_scalars(beta1, beta2, eps, step_size, inv_sqrt_bias_correction2,
                                          decay_factor, l2_weight_decay, grad_scale);
  float* param_data = param.mutable_data_ptr<float>();
  const float* grad_data = grad.const_data_ptr<float>();
  float* m_data = m.mutable_data_ptr<float>();
  float* v_data = v.mutable_data_ptr<float>();
  parallel_for_tasks(param.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
    step_32bit_range(param_data, grad_data, m_data, v_data, k, begin, end);
  });
}

at::Tensor sum_squares_cpu(at::TensorList tensors) {
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> first_chunk{0};  // first_chunk[t]: index of tensor t's first chunk
  for (const at::Tensor& tensor : tensors) {
    TORCH_CHECK(tensor.device().is_cpu(), "sum_squares: every tensor must be on the CPU, got ",
                tensor.device());
    TORCH_CHECK(tensor.scalar_type() == at::kFloat || tensor.scalar_type() == at::kBFloat16 ||
                    tensor.scalar_type() == at::kHalf,
                "sum_squares: tensors must be float32, bfloat16 or float16, got ",
                tensor.scalar_type());
    inputs.push_back(tensor.contiguous());
    const int64_t chunks = (tensor.numel() + kSumSquaresChunk - 1) / kSumSquaresChunk;
    first_chunk.push_back(first_chunk.back() + chunks);
  }
  std::vector<double> chunk_sums(first_chunk.back());
  // One parallel loop over the chunks of all tensors, so that many small tensors (biases, norms)
  // cost one OpenMP region rather than one each.
  parallel_for_tasks(first_chunk.back(), kElementsPerTask / kSumSquaresChunk,
                     [&](int64_t begin, int64_t end) {
                       sum_chunks_of_tensors(inputs, first_chunk, begin, end, chunk_sums.data());
                     });
  // Chunk sums added in a fixed order, whatever the thread count: the result is deterministic.
  double total = 0.0;
  for (const double sum : chunk_sums) total += sum;
  return at::scalar_tensor(total, at::TensorOptions().dtype(at::kDouble));
}

}  // namespace lazyzero::optim
