"""The MLP's SiLU gate and the MoE's routed + shared expert combine: torch references (the
model's own ops, roundings included)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, each op rounded to the inputs' dtype. gate, up [T, I] -> [T, I]."""
    return F.silu(gate) * up


def expert_combine_ref(routed: torch.Tensor, shared: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """routed + shared * sigmoid(gate_logit): the MoE block's output. routed, shared [T, H],
    gate_logit [T, 1] (the shared expert's gate); each op rounded to the inputs' dtype."""
    return routed + shared * torch.sigmoid(gate_logit)
