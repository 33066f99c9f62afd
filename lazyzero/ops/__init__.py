"""lazyzero's native ops: schemas in namespace `lazyzero`, PyTorch references, C++/CUDA kernels.

Importing this package defines the op schemas and never compiles anything; the kernels are built on
first use (see `lazyzero.ops.build`).
"""

from lazyzero.ops.quant import (
    BlockQuantized,
    dequantize_blockwise,
    dequantize_sum_int8,
    quantize_blockwise,
)

__all__ = ["BlockQuantized", "dequantize_blockwise", "dequantize_sum_int8", "quantize_blockwise"]
