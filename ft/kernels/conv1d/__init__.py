"""Causal depthwise conv1d with a rolling state: `reference.py` and the dispatcher. No Triton
kernel yet (the decode-graphs issue adds one)."""

from __future__ import annotations

import torch

from ft.kernels.conv1d.reference import causal_conv1d_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref"]


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher of `causal_conv1d_ref` (same contract): the reference on every device today."""
    return causal_conv1d_ref(x, state, weight)
