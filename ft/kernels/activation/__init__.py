"""Elementwise pieces of the MLPs: the SiLU gate (`silu_mul`) and the MoE block's routed + shared
expert combine (`expert_combine`). `reference.py` holds the model's torch ops, `kernel.py` one
Triton launch each (where torch takes two or three), and this module the dispatchers."""

from __future__ import annotations

import torch

from ft.kernels.activation.reference import expert_combine_ref, silu_mul_ref
from ft.kernels.backend import TRITON_DTYPES, uses_triton

__all__ = ["expert_combine", "expert_combine_ref", "silu_mul", "silu_mul_ref"]


def _triton(*ts: torch.Tensor) -> bool:
    return uses_triton(ts[0].device) and all(t.dtype in TRITON_DTYPES and t.dim() == 2 and t.stride(-1) == 1
                                             for t in ts)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] tensors: the Triton kernel where it runs, else the reference."""
    if _triton(gate, up):
        from ft.kernels.activation.kernel import silu_mul_triton  # NOTE: imports triton only when used

        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)


def expert_combine(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """routed + shared * sigmoid(gate_logit) ([T, H], [T, H], [T, 1]): Triton where it runs, else the reference."""
    if _triton(routed, shared) and gate_logit.dtype == routed.dtype:
        from ft.kernels.activation.kernel import expert_combine_triton  # NOTE: imports triton only when used

        return expert_combine_triton(routed, shared, gate_logit)
    return expert_combine_ref(routed, shared, gate_logit)
