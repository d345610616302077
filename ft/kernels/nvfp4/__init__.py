"""NVFP4 linear: y = x @ dequantize(W).T.

`reference.py` holds the format and the torch reference, `kernel.py` the Triton kernels (a GEMV
that reads the packed weight as 32-bit words for decode, ``tl.dot`` tiles for larger M),
`dequant_kernel.py` the prefill form (the weight decoded once, then cuBLAS), and this module the
dispatcher.
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
    "DEQUANT_MM_MIN_M", "nvfp4_linear", "nvfp4_linear_ref",
]


DEQUANT_MM_MIN_M = 1024
"""From this many rows of x (a prefill chunk) on, CUDA runs the NVFP4 linear as one decode pass of
the weight plus cuBLAS's GEMM (`dequant_kernel.nvfp4_linear_dequant_mm`) when the caller gives the
global scale's host value; below, the Triton kernels. H200 (bench/prefill_gemm.py, 2026-12-01): at
M 4,096 0.94-0.95x torch bf16 on the large projections against 0.44-0.49x for the `tl.dot` kernel;
at M 1,024 about even (both within host launch cost); at M 256 the one-launch kernel is faster."""


def nvfp4_linear(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float,
    scale_2_host: float | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(W).T with x [M, K] and NVFP4 W [N, K] -> y [M, N] in x's dtype.

    Dispatcher: the Triton kernels (`kernel.nvfp4_linear_triton`: a GEMV for small M, ``tl.dot``
    tiles above) where `uses_triton` says so, or from DEQUANT_MM_MIN_M rows on, with scale_2_host
    (scale_2's value as a float), the weight decoded once and cuBLAS's GEMM; `nvfp4_linear_ref`
    otherwise, and for block scales that are not float8_e4m3fn.
    """
    if uses_triton(x.device) and scale.dtype == torch.float8_e4m3fn and x.dtype in TRITON_DTYPES:
        # NOTE: imports triton only when used
        if scale_2_host is not None and x.shape[0] >= DEQUANT_MM_MIN_M:
            from ft.kernels.nvfp4.dequant_kernel import nvfp4_linear_dequant_mm

            return nvfp4_linear_dequant_mm(x, packed, scale, scale_2_host)
        from ft.kernels.nvfp4.kernel import nvfp4_linear_triton

        return nvfp4_linear_triton(x, packed, scale, scale_2)
    return nvfp4_linear_ref(x, packed, scale, scale_2)
