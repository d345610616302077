"""Qwen3-Next's RMSNorms: the (1 + weight) RMSNorm and the SiLU-gated RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32, returned in x's dtype. x [..., D]."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) * silu(gate), normalised before gating. x, gate [..., D]."""
    dtype = x.dtype
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    # NOTE: the product order and casts follow the reference so bf16 rounds the same way.
    return ((weight * y) * F.silu(gate.float())).to(dtype)
