"""Dense linear y = x @ W^T: the torch reference."""

from __future__ import annotations

import torch


def dense_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> y [M, N] in x's dtype: products and sums in fp32 (as cuBLAS and the
    Triton kernel accumulate), rounded once to x's dtype at the end."""
    return (x.float() @ w.float().T).to(x.dtype)
