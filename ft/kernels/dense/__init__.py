"""Dense linear y = x @ W^T at decode batch sizes: `reference.py` (torch), `kernel.py` (a Triton
skinny GEMM, one launch, for up to `DenseOptions.max_m` rows of x) and this dispatcher, which runs
the kernel where it applies and ``torch.nn.functional.linear`` (cuBLAS) everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.dense.reference import dense_linear_ref
from ft.kernels.options import kernel_options

__all__ = ["MAX_N", "dense_linear", "dense_linear_ref", "uses_dense_kernel"]

MAX_N = 4096
"""Rows of w up to which the Triton kernel runs: it is for the small projections where cuBLAS is
far from the copy ceiling (router, in_proj_ba, shared gate: ~5 us each on the H200); on large ones
such as lm_head (151936 x 2048 bf16: 144 us, 4.3 TB/s) cuBLAS is already at it."""


def uses_dense_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `dense_linear` runs the Triton kernel for x and w (else F.linear).

    The kernel runs where `uses_triton` says so, for w with at most `MAX_N` rows, x [M, K] with
    1 <= M <= `DenseOptions.max_m` (16) and unit stride along K (any row stride), w [N, K] with contiguous
    rows (unit stride along K), x and w of one dtype among fp32, bf16, fp16 on one device, and K a positive
    multiple of 16.
    """
    if x.dim() != 2 or w.dim() != 2 or x.dtype != w.dtype or x.dtype not in TRITON_DTYPES:
        return False
    m, k = x.shape
    return (uses_triton(x.device) and w.device == x.device and 1 <= m <= kernel_options().dense.max_m
            and w.shape[0] <= MAX_N and k > 0 and k % 16 == 0
            and w.shape[1] == k and x.stride(1) == 1 and w.stride(1) == 1)


def dense_linear(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T: x [M, K], w [N, K] -> y [M, N] in x's dtype, fp32 accumulation.

    Dispatcher: the Triton kernel (`kernel.dense_linear_triton`) where `uses_dense_kernel` says so,
    else ``F.linear(x, w)`` (any shapes F.linear takes; `out`, if given, is then copied into).

    Args:
        out: optional output of y's shape and dtype (the kernel also needs unit stride along N),
            written entirely and returned.
    """
    if uses_dense_kernel(x, w) and (out is None or out.stride(-1) == 1):
        # NOTE: imports triton only when used
        from ft.kernels.dense.kernel import dense_linear_triton

        return dense_linear_triton(x, w, out=out)
    y = F.linear(x, w)
    if out is None:
        return y
    return out.copy_(y)
