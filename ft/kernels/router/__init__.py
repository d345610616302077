"""Router top-k (softmax, top-k, optional renormalization): `reference.py`, the Triton kernel in
`kernel.py` (one launch), the routing from the hidden state with the router's GEMV in the same launch
(`hidden_kernel.py`), and these dispatchers."""

from __future__ import annotations

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.dense import dense_linear, uses_dense_kernel
from ft.kernels.options import kernel_options
from ft.kernels.router.reference import route_forced_ref, route_ref, router_topk_ref

__all__ = ["ROUTE_COUNTERS", "route", "route_forced_ref", "route_hidden", "route_ref", "router_topk", "router_topk_ref"]

ROUTE_COUNTERS = 16
"""The int32 counters `route_hidden` needs at most (one per block of tokens, `hidden_kernel.MAX_TOKENS`
tokens at one token a block), zero between calls: a call site allocates them once."""


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


def route_hidden(
    x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool, *, counters: torch.Tensor | None,
    shared_gate: bool = False, slot_table: torch.Tensor | None = None, forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`route(dense_linear(x, weight), ...)`: x [T, K], weight [E + S, K] dense (the router's rows, then
    the shared gate's with `shared_gate`); one launch (`hidden_kernel`) where the dense decode kernel
    takes x and weight, T is at most `ROUTE_COUNTERS`, `counters` (int32 [ROUTE_COUNTERS] on x's
    device, zero, kept zero) is given and `MoeOptions.decode_route_one_launch` is on, else the GEMV and
    `route` as two."""
    e = weight.shape[0] - int(shared_gate)
    if (counters is not None and kernel_options().moe.decode_route_one_launch and uses_dense_kernel(x, weight)
            and x.shape[0] <= ROUTE_COUNTERS and e <= 8192 and counters.device == x.device
            and counters.numel() >= ROUTE_COUNTERS):
        from ft.kernels.router.hidden_kernel import route_hidden_triton  # NOTE: imports triton only when used

        return route_hidden_triton(x, weight, top_k, normalize, counters, shared_gate=shared_gate,
                                   slot_table=slot_table, forced=forced)
    return route(dense_linear(x, weight), top_k, normalize, shared_gate=shared_gate, slot_table=slot_table,
                 forced=forced)
