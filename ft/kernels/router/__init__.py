"""Router top-k (softmax, top-k, optional renormalization): `reference.py`, the Triton kernel in
`kernel.py` (one launch), and this dispatcher."""

from __future__ import annotations

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.router.reference import route_forced_ref, route_ref, router_topk_ref

__all__ = ["route", "route_forced_ref", "route_ref", "router_topk", "router_topk_ref"]


def router_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the Triton kernel (`kernel.py`) on CUDA (or in interpreter tests), else `router_topk_ref`."""
    if uses_triton(logits.device) and logits.shape[-1] <= 8192:
        # NOTE: imports triton only when used
        from ft.kernels.router.kernel import router_topk_triton

        return router_topk_triton(logits, top_k, normalize)
    return router_topk_ref(logits, top_k, normalize)


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, *, shared_gate: bool = False,
    slot_table: torch.Tensor | None = None, forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The MoE block's routing (`route_ref`'s contract): top-k weights and ids, the shared expert's
    gate weight and the experts' slots, in one Triton launch on CUDA (or in interpreter tests).
    With `forced` [T, k] the experts are given (`route_forced_ref`'s contract)."""
    if uses_triton(logits.device) and logits.shape[-1] - int(shared_gate) <= 8192:
        from ft.kernels.router.kernel import route_triton  # NOTE: imports triton only when used

        return route_triton(logits, top_k, normalize, shared_gate=shared_gate, slot_table=slot_table, forced=forced)
    if forced is not None:
        return route_forced_ref(logits, forced, normalize, shared_gate=shared_gate, slot_table=slot_table)
    return route_ref(logits, top_k, normalize, shared_gate=shared_gate, slot_table=slot_table)
