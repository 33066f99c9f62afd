// Element math of block-wise quantization, shared by the CPU and CUDA kernels.
//
// The specification is lazyzero/ops/quant_reference.py. Both backends call these functions so that
// they perform the same fp32 operations in the same order and agree with the reference bit for bit.
// On the device every multiply, add and divide is written with an explicit round-to-nearest
// intrinsic: nvcc would otherwise contract `acc + a * b` into an FMA, whose single rounding differs
// from the reference's two. The host build passes -ffp-contract=off for the same reason.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define LZ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LZ_HOST_DEVICE inline
#endif

namespace lazyzero::quant {

constexpr float kInt8Max = 127.0f;
constexpr float kInt4Max = 7.0f;

// |x| as raw bits. For non-negative floats the unsigned-integer order equals the float order, and
// every NaN pattern sorts above +Inf, so an integer max over these bits yields NaN if the block has
// a NaN, else +Inf if it has an Inf, else absmax: the whole block classification in one
// branch-free, vectorizable reduction.
constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kQuietNanBits = 0x7fc00000u;

// splitmix64 (Steele, Lea, Flood 2014): a counter-based hash gives each element its own uniform
// from (seed, global index) alone, so any thread on any backend can draw it without shared state.
constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMixMultiplier1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMixMultiplier2 = 0x94D049BB133111EBull;

LZ_HOST_DEVICE uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

LZ_HOST_DEVICE float float_of(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

LZ_HOST_DEVICE uint32_t abs_bits(float x) { return bits_of(x) & kAbsMask; }

LZ_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LZ_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

LZ_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Round half to even, like torch.round.
LZ_HOST_DEVICE float round_half_even(float v) {
#if defined(__CUDA_ARCH__)
  return rintf(v);
#else
  return std::nearbyint(v);
#endif
}

LZ_HOST_DEVICE float round_down(float v) {
#if defined(__CUDA_ARCH__)
  return floorf(v);
#else
  return std::floor(v);
#endif
}

// Ternaries rather than fminf/fmaxf: they compile to minps/maxps on x86 and keep loops vectorized.
LZ_HOST_DEVICE float clamp_code(float q, float qmax) {
  q = q < -qmax ? -qmax : q;
  return q > qmax ? qmax : q;
}

// Scale of a block from the max of abs_bits over it: NaN, +Inf, or absmax / qmax.
LZ_HOST_DEVICE float scale_from_absmax_bits(uint32_t absmax_bits, float qmax) {
  if (absmax_bits > kInfBits) return float_of(kQuietNanBits);
  return div_rn(float_of(absmax_bits), qmax);
}

// How codes are rounded: qmax 127 (int8) or 7 (int4); stochastic draws use `key`.
struct Rounding {
  float qmax;
  bool stochastic;
  uint64_t key;  // stream_key(seed); unused when !stochastic
};

// How a block's codes are produced, decided once per block from its scale.
enum class BlockKind { kFinite, kZero, kNonFinite };

LZ_HOST_DEVICE BlockKind classify_block(float scale) {
  if (abs_bits(scale) >= kInfBits) return BlockKind::kNonFinite;
  return scale == 0.0f ? BlockKind::kZero : BlockKind::kFinite;
}

LZ_HOST_DEVICE float nearest_code(float x, float scale, float qmax) {
  return clamp_code(round_half_even(div_rn(x, scale)), qmax);
}

LZ_HOST_DEVICE float stochastic_code(float x, float scale, float qmax, float uniform) {
  return clamp_code(round_down(add_rn(div_rn(x, scale), uniform)), qmax);
}

// In a NaN/Inf block: +-qmax for +-Inf (times a +Inf scale gives +-Inf back), 0 elsewhere (times a
// NaN or Inf scale gives NaN), so no element of the block dequantizes to a finite number.
LZ_HOST_DEVICE float nonfinite_block_code(float x, float qmax) {
  if (abs_bits(x) != kInfBits) return 0.0f;
  return x > 0.0f ? qmax : -qmax;
}

LZ_HOST_DEVICE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMixMultiplier1;
  z = (z ^ (z >> 27)) * kMixMultiplier2;
  return z ^ (z >> 31);
}

// Per-call key: mixing the seed once makes nearby seeds give unrelated streams.
LZ_HOST_DEVICE uint64_t stream_key(int64_t seed) { return mix64(static_cast<uint64_t>(seed)); }

// Uniform in [0, 1) with 24 random bits, exactly representable in fp32.
LZ_HOST_DEVICE float uniform_at(uint64_t key, int64_t index) {
  const uint64_t hashed = mix64(key + static_cast<uint64_t>(index) * kGoldenGamma);
  return static_cast<float>(static_cast<int32_t>(hashed >> 40)) * 0x1p-24f;
}

LZ_HOST_DEVICE float dequantize_code(int32_t code, float scale) {
  return mul_rn(static_cast<float>(code), scale);
}

// int4 packing: element 2j in the low nibble of byte j, element 2j+1 in the high nibble, each a
// 4-bit two's-complement number.
LZ_HOST_DEVICE uint8_t pack_nibbles(int32_t low_code, int32_t high_code) {
  return static_cast<uint8_t>((low_code & 0xF) | ((high_code & 0xF) << 4));
}

// `(nibble ^ 8) - 8` sign-extends a 4-bit two's-complement number without branches.
LZ_HOST_DEVICE int32_t low_nibble_code(uint8_t byte) { return ((byte & 0xF) ^ 8) - 8; }

LZ_HOST_DEVICE int32_t high_nibble_code(uint8_t byte) { return ((byte >> 4) ^ 8) - 8; }

}  // namespace lazyzero::quant
