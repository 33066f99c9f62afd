// CPU kernels of every lazyzero op, attached to the schemas defined in Python (lazyzero/ops/*.py).
// CUDA kernels register themselves in their own .cu files, which are built only where CUDA exists.
#include <torch/library.h>

#include "adam8bit/adam_cpu.h"
#include "norms/rms_norm_cpu.h"
#include "quant/quant_cpu.h"

TORCH_LIBRARY_IMPL(lazyzero, CPU, m) {
  using namespace lazyzero::quant;
  m.impl("quantize_int8", &quantize_int8_cpu);
  m.impl("quantize_int8_into", &quantize_int8_into_cpu);
  m.impl("quantize_int4", &quantize_int4_cpu);
  m.impl("dequantize_int8", &dequantize_int8_cpu);
  m.impl("dequantize_int8_into", &dequantize_int8_into_cpu);
  m.impl("dequantize_int4", &dequantize_int4_cpu);
  m.impl("dequantize_sum_int8", &dequantize_sum_int8_cpu);
  m.impl("dequantize_sum_int8_into", &dequantize_sum_int8_into_cpu);
  m.impl("quantize_int8_outliers", &quantize_int8_outliers_cpu);
  m.impl("quantize_int4_outliers", &quantize_int4_outliers_cpu);
  m.impl("restore_block_outliers_", &restore_block_outliers_cpu);
  m.impl("quantize_token_blocks", &quantize_token_blocks_cpu);
  m.impl("restore_token_blocks", &restore_token_blocks_cpu);
}

TORCH_LIBRARY_IMPL(lazyzero, CPU, m) {
  using namespace lazyzero::optim;
  m.impl("adam8bit_step_", &adam8bit_step_cpu);
  m.impl("adam32_step_", &adam32_step_cpu);
  m.impl("sum_squares", &sum_squares_cpu);
}

TORCH_LIBRARY_IMPL(lazyzero, CPU, m) {
  using namespace lazyzero::norms;
  m.impl("rms_norm_rows", &rms_norm_rows_cpu);
  m.impl("rms_norm_rows_backward", &rms_norm_rows_backward_cpu);
}
