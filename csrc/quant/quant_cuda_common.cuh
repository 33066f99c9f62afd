// Launch geometry and warp-level pieces shared by the CUDA kernels of csrc/quant/*.cu (spec:
// lazyzero/ops/quant_reference.py); all fp32 arithmetic goes through lazyzero/quant_math.h.
#pragma once

#include <lazyzero/quant_math.h>

#include <algorithm>
#include <cstdint>

namespace lazyzero::quant {

constexpr int kWarpSize = 32;
constexpr int kThreadsPerCta = 256;
// Grid-stride loops cover any size; more CTAs than this only adds scheduling overhead.
constexpr int64_t kMaxCtas = 4096;

inline int64_t ctas_for(int64_t threads_wanted) {
  return std::clamp<int64_t>((threads_wanted + kThreadsPerCta - 1) / kThreadsPerCta, 1, kMaxCtas);
}

__device__ __forceinline__ int64_t global_thread_index() {
  return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
}

__device__ __forceinline__ int64_t grid_threads() {
  return gridDim.x * static_cast<int64_t>(blockDim.x);
}

__device__ __forceinline__ uint32_t warp_max(uint32_t value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = max(value, __shfl_xor_sync(0xffffffffu, value, offset));
  }
  return value;
}

// Code of element `index` (global) of a block whose scale and kind are known.
__device__ __forceinline__ int32_t element_code(float x, float scale, BlockKind kind,
                                                const Rounding& rounding, int64_t index) {
  float code = 0.0f;
  if (kind == BlockKind::kNonFinite) {
    code = nonfinite_block_code(x, rounding.qmax);
  } else if (kind == BlockKind::kFinite) {
    code = rounding.stochastic
               ? stochastic_code(x, scale, rounding.qmax, uniform_at(rounding.key, index))
               : nearest_code(x, scale, rounding.qmax);
  }
  return static_cast<int32_t>(code);
}

}  // namespace lazyzero::quant
