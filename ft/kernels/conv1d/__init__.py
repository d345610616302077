"""Causal depthwise conv1d with a rolling state: `reference.py` (one batch of equal lengths, and packed
sequences with their states in a pool), the packed kernel `kernel.causal_conv1d_varlen_triton` (one
launch, prefill), and the dispatchers. The decode step's conv is fused into the gated delta decode
kernels (`ft.kernels.gated_delta`)."""

from __future__ import annotations

import torch

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.conv1d.reference import causal_conv1d_ref, causal_conv1d_varlen_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref", "causal_conv1d_varlen", "causal_conv1d_varlen_ref"]


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher of `causal_conv1d_ref` (same contract): the reference on every device today."""
    return causal_conv1d_ref(x, state, weight)


def causal_conv1d_varlen(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU over sequences packed along T, states in a pool at slots (read,
    then replaced in place).

    x [T, C], conv_state [S, C, W-1], weight [C, W], cu_seqlens [B+1] and slots [B] (int32/int64 on
    x's device) -> y [T, C] in x's dtype. Dispatcher: `kernel.causal_conv1d_varlen_triton` (one launch,
    no host sync) where `uses_triton` says so, else `causal_conv1d_varlen_ref` (a loop over the sequences).
    """
    if uses_triton(x.device) and x.dtype in TRITON_DTYPES:
        from ft.kernels.conv1d import kernel  # NOTE: imports triton only when used

        return kernel.causal_conv1d_varlen_triton(x, conv_state, weight, cu_seqlens, slots)
    return causal_conv1d_varlen_ref(x, conv_state, weight, cu_seqlens, slots)
