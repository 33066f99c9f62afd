"""lazyzero's native ops: schemas in namespace `lazyzero`, PyTorch references, C++/CUDA kernels.

Importing this package defines the op schemas and never compiles anything; the kernels are built on
first use (see `lazyzero.ops.native_build`).
"""

from lazyzero.ops.adam8bit import (
    adam8bit_step_,
    adam32_step_,
    dequantize_m,
    dequantize_s,
    quantize_m,
    quantize_s,
    sum_squares,
)
from lazyzero.ops.quant import (
    BlockQuantized,
    dequantize_blockwise,
    dequantize_sum_int8,
    quantize_blockwise,
)

__all__ = [
    "BlockQuantized",
    "adam32_step_",
    "adam8bit_step_",
    "dequantize_blockwise",
    "dequantize_m",
    "dequantize_s",
    "dequantize_sum_int8",
    "quantize_blockwise",
    "quantize_m",
    "quantize_s",
    "sum_squares",
]
