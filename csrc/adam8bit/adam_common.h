// Element math of the fused Adam steps, shared by the CPU and CUDA kernels.
//
// The specification is lazyzero/ops/adam8bit_reference.py; every function here performs the same
// fp32 operations in the same order so that both backends agree with it bit for bit. On the device
// each operation goes through an explicit round-to-nearest intrinsic (mul_rn, add_rn, ...), which
// nvcc never contracts into an FMA; the host build passes -ffp-contract=off for the same reason.
// Everything is branch-free (selects on uint32 bit patterns) so that gcc vectorizes the CPU loops.
//
// Functions (names are stable; the CUDA kernels call them):
//   sub_rn(a, b), sqrt_rn(x)                 IEEE fp32 a - b and sqrt, never contracted
//   block_scale_from_absmax_bits(bits)       fp32 scale of a block from max abs_bits() over it
//   inverse_scale(scale)                     1 / scale, or 0 for a zero scale (all codes 0 then)
//   encode_m(x, inv_scale) -> uint8          first-moment code, "E4M3 bias 15" plus sign bit
//   decode_m(code, scale) -> float           sign * magnitude(code) * scale
//   encode_s(s, inv_scale) -> uint8          sqrt(second moment) code, unsigned "E4M4 bias 15"
//   decode_s(code, scale) -> float           magnitude(code) * scale
//   AdamScalars make_adam_scalars(...)       host: the op's double arguments cast once to fp32
//   AdamElement adam_element_step(param, grad, m_hat, v_hat, scalars)
//                                            one element's new param, m, v and s = sqrt(v)
#pragma once

#include <lazyzero/quant_math.h>

#include <cstdint>

namespace lazyzero::optim {

using quant::abs_bits;
using quant::add_rn;
using quant::bits_of;
using quant::div_rn;
using quant::float_of;
using quant::mul_rn;

constexpr int64_t kMinBlockSize = 32;
constexpr int64_t kMaxBlockSize = 4096;

// Block absmax below the smallest normal fp32 (2^-126) flushes the block to zero: 1 / scale would
// overflow to +Inf for the smallest of them and turn |0| * inv into NaN. A first moment decays
// into that range after ~800 steps without gradient, and such a value is far below anything the
// update can resolve (|m| / eps < 1e-30).
constexpr uint32_t kMinNormalBits = 0x00800000u;
// 2^-14, the smallest normal code value (below it codes are subnormal), and its fp32 bits: an
// exponent field with a zero mantissa.
constexpr uint32_t kMinNormalCodeBits = 0x38800000u;
constexpr float kMinNormalCodeValue = 0x1p-14f;
// fp32 exponent bias (127) minus the code's exponent bias (15).
constexpr uint32_t kExponentRebias = 112u;

LZ_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

LZ_HOST_DEVICE float sqrt_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);
#endif
}

// absmax as a scale: kept as is, NaN and +Inf included; 0 for a zero or subnormal absmax.
LZ_HOST_DEVICE float block_scale_from_absmax_bits(uint32_t absmax_bits) {
  return float_of(absmax_bits < kMinNormalBits ? 0u : absmax_bits);
}

LZ_HOST_DEVICE float inverse_scale(float scale) {
  return scale == 0.0f ? 0.0f : div_rn(1.0f, scale);
}

// min(y, 1), where a NaN (non-finite block) also becomes 1 so that codes stay in range.
LZ_HOST_DEVICE float clamp_to_one(float y) { return y < 1.0f ? y : 1.0f; }

// Minifloat code of 0 <= y <= 1 with kMantissaBits mantissa bits, exponent bias 15 and subnormals
// (exponent field 0, step 2^-(14 + kMantissaBits)), rounded to nearest even: the same codes as the
// reference's two-case formula (mantissa rounding on the bit pattern for y >= 2^-14,
// round_half_even(y * 2^(14 + kMantissaBits)) below), in one branch-free case with fewer vector
// operations. Adding the aligner 2^(e + 23 - kMantissaBits), e = max(exponent of y, -14), makes the
// fp32 adder round y to a multiple of 2^(e - kMantissaBits), ties to even, and leaves the number of
// such steps in the low bits of the sum; the code is that count plus 2^kMantissaBits per binade
// above 2^-14. An exhaustive comparison over all fp32 y in [0, 1] found no difference.
template <int kMantissaBits>
LZ_HOST_DEVICE uint32_t minifloat_code(float y) {
  constexpr uint32_t kExponentMask = 0x7F800000u;
  constexpr uint32_t kAlignerOffset = (23u - kMantissaBits) << 23;
  const uint32_t exponent = bits_of(y) & kExponentMask;
  const uint32_t clamped = exponent > kMinNormalCodeBits ? exponent : kMinNormalCodeBits;
  const uint32_t aligner = clamped + kAlignerOffset;
  const uint32_t steps = bits_of(add_rn(y, float_of(aligner))) - aligner;
  return ((clamped - kMinNormalCodeBits) >> (23 - kMantissaBits)) + steps;
}

// Value of a minifloat code (see minifloat_code), exact. A subnormal code M (exponent field 0) is
// M * 2^-(14 + kMantissaBits), computed as (1 + M * 2^-kMantissaBits) * 2^-14 - 2^-14: exact
// (Sterbenz), and cheaper than an int-to-float conversion on the vector units.
template <int kMantissaBits>
LZ_HOST_DEVICE float minifloat_value(uint32_t code) {
  constexpr uint32_t kLargestSubnormalCode = (1u << kMantissaBits) - 1u;
  const uint32_t normal_bits = (code << (23 - kMantissaBits)) + (kExponentRebias << 23);
  const float subnormal = sub_rn(float_of(normal_bits + (1u << 23)), kMinNormalCodeValue);
  return code <= kLargestSubnormalCode ? subnormal : float_of(normal_bits);
}

// First moment: bit 7 = (x < 0), bits 0..6 = E4M3 code of |x| * inv_scale. -0 encodes as +0.
LZ_HOST_DEVICE uint8_t encode_m(float x, float inv_scale) {
  const uint32_t sign = x < 0.0f ? 0x80u : 0u;
  const float y = clamp_to_one(mul_rn(float_of(abs_bits(x)), inv_scale));
  return static_cast<uint8_t>(sign | minifloat_code<3>(y));
}

LZ_HOST_DEVICE float decode_m(uint8_t code, float scale) {
  const uint32_t sign = (static_cast<uint32_t>(code) & 0x80u) << 24;
  const float magnitude = minifloat_value<3>(static_cast<uint32_t>(code) & 0x7Fu);
  return mul_rn(float_of(bits_of(magnitude) | sign), scale);
}

// Square root of the second moment: E4M4 code of s * inv_scale. s = sqrt(v) is +0, positive or
// NaN, so no |.| is needed (minifloat_code ignores the sign bit of -0 anyway).
LZ_HOST_DEVICE uint8_t encode_s(float s, float inv_scale) {
  return static_cast<uint8_t>(minifloat_code<4>(clamp_to_one(mul_rn(s, inv_scale))));
}

LZ_HOST_DEVICE float decode_s(uint8_t code, float scale) {
  return mul_rn(minifloat_value<4>(static_cast<uint32_t>(code)), scale);
}

// The op's scalar arguments, each cast from double to fp32 once, at the kernel's entry.
struct AdamScalars {
  float beta1;
  float beta2;
  float one_minus_beta1;  // (float)(1 - beta1), the difference taken in double
  float one_minus_beta2;
  float eps;
  float step_size;  // lr / (1 - beta1^t)
  float inv_sqrt_bias_correction2;  // 1 / sqrt(1 - beta2^t)
  float decay_factor;  // AdamW: 1 - lr * weight_decay; Adam: 1
  float l2_weight_decay;  // Adam: weight_decay; AdamW: 0
  float grad_scale;
};

inline AdamScalars make_adam_scalars(double beta1, double beta2, double eps, double step_size,
                                     double inv_sqrt_bias_correction2, double decay_factor,
                                     double l2_weight_decay, double grad_scale) {
  return AdamScalars{static_cast<float>(beta1),
                     static_cast<float>(beta2),
                     static_cast<float>(1.0 - beta1),
                     static_cast<float>(1.0 - beta2),
                     static_cast<float>(eps),
                     static_cast<float>(step_size),
                     static_cast<float>(inv_sqrt_bias_correction2),
                     static_cast<float>(decay_factor),
                     static_cast<float>(l2_weight_decay),
                     static_cast<float>(grad_scale)};
}

struct AdamElement {
  float param;
  float m;
  float v;
  float s;  // sqrt(v): what 8-bit states quantize
};

// One element of Adam/AdamW from the old param, the gradient and the old (dequantized) moments;
// v_hat is the old second moment (s_hat * s_hat for 8-bit states).
LZ_HOST_DEVICE AdamElement adam_element_step(float param, float grad, float m_hat, float v_hat,
                                             const AdamScalars& k) {
  float g = mul_rn(grad, k.grad_scale);
  g = add_rn(g, mul_rn(k.l2_weight_decay, param));
  const float m = add_rn(mul_rn(k.beta1, m_hat), mul_rn(k.one_minus_beta1, g));
  const float v = add_rn(mul_rn(k.beta2, v_hat), mul_rn(k.one_minus_beta2, mul_rn(g, g)));
  const float s = sqrt_rn(v);
  const float denom = add_rn(mul_rn(s, k.inv_sqrt_bias_correction2), k.eps);
  const float decayed = mul_rn(param, k.decay_factor);
  return AdamElement{sub_rn(decayed, mul_rn(k.step_size, div_rn(m, denom))), m, v, s};
}

}  // namespace lazyzero::optim
