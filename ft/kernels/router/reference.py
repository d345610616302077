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


def route_ref(
    logits: torch.Tensor, top_k: int, normalize: bool, *, shared_gate: bool = False,
    slot_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The MoE block's routing: logits [T, E + S] -> (weights [T, k + S] in logits' dtype, ids
    [T, k] int64, slots [T, k] int32 or None).

    With `shared_gate` (S = 1) the last logit column is the shared expert's gate and its weight,
    sigmoid(gate), follows the k routed weights. With `slot_table` ([E] integer, -1 = no slot)
    the slots are slot_table[ids]."""
    e = logits.shape[-1] - int(shared_gate)
    weights, ids = router_topk_ref(logits[:, :e], top_k, normalize)
    if shared_gate:
        weights = torch.cat([weights, torch.sigmoid(logits[:, e:].float()).to(logits.dtype)], dim=1)
    slots = None if slot_table is None else slot_table[ids].to(torch.int32)
    return weights, ids, slots


def route_forced_ref(
    logits: torch.Tensor, ids: torch.Tensor, normalize: bool, *, shared_gate: bool = False,
    slot_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`route_ref` with the experts given: ids [T, k] chosen elsewhere (a synthetic trace); the
    weights are the router's softmax at them (renormalised with `normalize`), in logits' dtype.
    Torch ops only, no host sync (a CUDA graph may capture it)."""
    e = logits.shape[-1] - int(shared_gate)
    probs = torch.softmax(logits[:, :e].float(), dim=-1).gather(1, ids)
    if normalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    weights = probs.to(logits.dtype)
    if shared_gate:
        weights = torch.cat([weights, torch.sigmoid(logits[:, e:].float()).to(logits.dtype)], dim=1)
    slots = None if slot_table is None else slot_table[ids].to(torch.int32)
    return weights, ids, slots
