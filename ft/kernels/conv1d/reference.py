"""Causal depthwise conv1d with a rolling state (Gated DeltaNet's short convolution)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over new inputs, continuing from a state, then SiLU.

    Args:
        x: [B, T, C] new inputs.
        state: [B, C, W-1] the last W-1 inputs before x (zeros for a new sequence).
        weight: [C, W] (a Conv1d weight [C, 1, W] squeezed).
    Returns:
        (y [B, T, C] in x's dtype, new state [B, C, W-1] in state's dtype).
    """
    t = x.shape[1]
    width = weight.shape[-1]
    xx = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, W-1+T]
    y = F.conv1d(xx.to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])  # [B, C, T]
    new_state = xx[..., -(width - 1):].to(state.dtype)
    return F.silu(y).transpose(1, 2).to(x.dtype)[:, :t], new_state
