"""Softmax router top-k: the torch reference."""

from __future__ import annotations

import torch


def router_topk_ref(
    logits: torch.Tensor, top_k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: logits [T, E] -> (weights [T, k] in logits' dtype, ids [T, k] int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids
