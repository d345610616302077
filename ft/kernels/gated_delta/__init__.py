"""The gated delta rule (Gated DeltaNet's linear attention): recurrent and chunked torch references
in `reference.py`, and the dispatcher. No Triton kernel yet (the decode-graphs issue adds one)."""

from __future__ import annotations

import torch

from ft.kernels.gated_delta.reference import chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref

__all__ = ["chunk_gated_delta_rule_ref", "gated_delta_rule", "recurrent_gated_delta_rule_ref"]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: one token per sequence runs the recurrent form, longer runs the chunked form."""
    if q.shape[1] == 1:
        return recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, state)
