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


def causal_conv1d_varlen_ref(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """`causal_conv1d_ref` over sequences packed along T, with their states in a pool (a loop over them).

    Args:
        x: [T, C]; sequence b is x[cu_seqlens[b]:cu_seqlens[b+1]].
        conv_state: [S, C, W-1]: sequence b's state at slots[b], read and replaced in place.
        weight: [C, W]; cu_seqlens: [B+1]; slots: [B] distinct (both read on the host: syncs on a GPU).
    Returns:
        y [T, C] in x's dtype (a sequence of length 0 gives no rows and keeps its state).
    """
    cu, slot_list = cu_seqlens.tolist(), slots.tolist()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    for b, slot in enumerate(slot_list):
        if cu[b + 1] == cu[b]:  # NOTE: conv1d rejects an input shorter than the kernel
            continue
        yb, new_state = causal_conv1d_ref(x[None, cu[b]:cu[b + 1]], conv_state[slot:slot + 1], weight)
        y[cu[b]:cu[b + 1]] = yb[0]
        conv_state[slot] = new_state[0]
    return y
