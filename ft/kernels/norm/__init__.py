"""Qwen3-Next's norms and partial rotary: `reference.py` (the model's math, bitwise), the Triton
kernels in `kernel.py` (one launch each) and these dispatchers."""

from __future__ import annotations

import torch

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.norm.reference import (
    add_rms_norm_ref,
    gated_rms_norm_ref,
    norm_rope_ref,
    qk_norm_rope_ref,
    rms_norm_ref,
    rotary_apply_ref,
    rotary_cos_sin_ref,
    rotary_inv_freq_ref,
)

__all__ = [
    "add_rms_norm", "add_rms_norm_ref", "gated_rms_norm", "gated_rms_norm_ref", "norm_rope", "norm_rope_ref",
    "qk_norm_rope", "qk_norm_rope_ref", "rms_norm", "rms_norm_ref", "rotary_apply_ref", "rotary_cos_sin_ref",
    "rotary_inv_freq_ref",
]


def _kernels(x: torch.Tensor):
    """The Triton kernels module (`kernel.py`) where it runs for x, else None."""
    if not (uses_triton(x.device) and x.dtype in TRITON_DTYPES):
        return None
    from ft.kernels.norm import kernel  # NOTE: imports triton only when used

    return kernel if 1 <= x.shape[-1] <= kernel.MAX_D else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA (or in interpreter tests), else `rms_norm_ref`. x [..., D]."""
    if (kernels := _kernels(x)) is not None:
        return kernels.rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for (rms_norm(residual + x), residual + x): the Triton kernel (one launch), else the reference."""
    if (kernels := _kernels(x)) is not None:
        return kernels.add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   activation: str = "silu") -> torch.Tensor:
    """Dispatcher for weight * rmsnorm(x) * act(gate) (act "silu" or "sigmoid"): the Triton kernel, else
    `gated_rms_norm_ref`. x, gate [..., D]."""
    if (kernels := _kernels(x)) is not None:
        return kernels.gated_rms_norm_triton(x, gate, weight, eps, activation=activation)
    return gated_rms_norm_ref(x, gate, weight, eps, activation)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher for the q/k RMSNorm + partial rotary (new q [T, Hq, D], k [T, Hk, D]): the Triton kernel
    (one launch, cos/sin from positions in-kernel), else `qk_norm_rope_ref`."""
    if (kernels := _kernels(q)) is not None:
        return kernels.qk_norm_rope_triton(q, k, q_weight, k_weight, positions, inv_freq, rotary_dim, eps)
    return qk_norm_rope_ref(q, k, q_weight, k_weight, positions, inv_freq, rotary_dim, eps)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
              rotary_dim: int, eps: float) -> torch.Tensor:
    """One tensor's RMSNorm ((1 + w), per head) then partial rotary: new x [T, H, D] (QSA's indexer
    query). The q/k kernel's launch with no k heads (one launch), else `norm_rope_ref`."""
    if (kernels := _kernels(x)) is not None:
        return kernels.qk_norm_rope_triton(x, x[:, :0], weight, weight, positions, inv_freq, rotary_dim, eps)[0]
    return norm_rope_ref(x, weight, positions, inv_freq, rotary_dim, eps)
