// dtype dispatch for the floating types lazyzero kernels accept (fp32, bf16, fp16).
// Double is left out on purpose: the kernels compute in fp32 and silently narrowing a double input
// would hide a caller's mistake.
#pragma once

#include <ATen/Dispatch.h>

#define LZ_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                  \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
