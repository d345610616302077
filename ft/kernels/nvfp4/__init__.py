"""NVFP4 linear: y = x @ dequantize(W).T.

`reference.py` holds the format and the torch reference, `kernel.py` the Triton kernels (a GEMV
that reads the packed weight as 32-bit words for decode, ``tl.dot`` tiles for larger M), and this
module the dispatcher.
"""

from __future__ import annotations

import torch

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.nvfp4.reference import (
    BLOCK_SIZE,
    E2M1_BOUNDS,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    dequantize_nvfp4,
    dequantize_nvfp4_rows,
    nvfp4_linear_ref,
)

__all__ = [
    "BLOCK_SIZE", "E2M1_BOUNDS", "E2M1_MAX", "E2M1_VALUES", "E4M3_MAX", "dequantize_nvfp4", "dequantize_nvfp4_rows",
    "nvfp4_linear", "nvfp4_linear_ref",
]


def nvfp4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float
) -> torch.Tensor:
    """y = x @ dequantize(W).T with x [M, K] and NVFP4 W [N, K] -> y [M, N] in x's dtype.

    Dispatcher: the Triton kernels (`kernel.nvfp4_linear_triton`: a GEMV for small M, ``tl.dot``
    tiles above) where `uses_triton` says so; `nvfp4_linear_ref` otherwise, and for block scales
    that are not float8_e4m3fn.
    """
    if uses_triton(x.device) and scale.dtype == torch.float8_e4m3fn and x.dtype in TRITON_DTYPES:
        # NOTE: imports triton only when used
        from ft.kernels.nvfp4.kernel import nvfp4_linear_triton

        return nvfp4_linear_triton(x, packed, scale, scale_2)
    return nvfp4_linear_ref(x, packed, scale, scale_2)
