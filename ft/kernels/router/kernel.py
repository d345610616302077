"""Triton MoE router: softmax over the experts, top-k, optional renormalization (details module of `ft.kernels.moe`).

One program per token: the row of router logits [E] is read once, the softmax is taken in fp32,
and the k largest probabilities are picked by k rounds of argmax (ties to the lowest expert id),
each round masking its winner; k is small (10 of 512 for the flagship), E fits one tile. Same
contract as `ft.kernels.moe.router_topk_ref`: weights in descending order, in the logits' dtype,
expert ids int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["route_outputs", "route_row", "route_triton", "router_topk_triton"]


def router_warps(e: int) -> int:
    """Warps per token: one up to 1024 experts (the k argmax rounds reduce within a warp, no
    shared-memory barriers: 4.2 against 5.1 us with 4 warps at 512 experts on the H200,
    bench/moe_decode.py), else 8."""
    return 1 if e <= 1024 else 8


@triton.jit
def _router_topk_kernel(p_logits, p_w, p_ids, p_table, p_slots, E, K, stride_lt, stride_wt, stride_it, stride_st,
                        NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                        SHARED_GATE: tl.constexpr = False, HAS_TABLE: tl.constexpr = False,
                        FORCED: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    route_row(p_logits, p_w, p_ids, p_table, p_slots, tl.program_id(0), E, K, stride_lt, stride_wt, stride_it,
              stride_st, NORMALIZE, BLOCK_E, BLOCK_K, SHARED_GATE, HAS_TABLE, FORCED)


@triton.jit
def route_row(p_logits, p_w, p_ids, p_table, p_slots, i_t, E, K, stride_lt, stride_wt, stride_it, stride_st,
              NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SHARED_GATE: tl.constexpr,
              HAS_TABLE: tl.constexpr, FORCED: tl.constexpr):
    """Token i_t's routing (`_router_topk_kernel`'s program, also `expert_lookup`'s fused route and lookup):
    stores its weights, ids (unless FORCED) and with HAS_TABLE slots; returns the ids, int64 [BLOCK_K]
    (0 past K)."""
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    b_l = tl.load(p_logits + i_t * stride_lt + o_e, mask=m_e, other=float("-inf")).to(tl.float32)
    mx = tl.max(b_l, axis=0)
    b_p = tl.exp(b_l - mx)
    denom = tl.sum(b_p, axis=0)
    o_k = tl.arange(0, BLOCK_K)
    if FORCED:  # the experts are given (p_ids holds them: a synthetic trace); weights = softmax at them
        b_i = tl.load(p_ids + i_t * stride_it + o_k, mask=o_k < K, other=0)
        b_f = tl.load(p_logits + i_t * stride_lt + b_i, mask=o_k < K, other=float("-inf")).to(tl.float32)
        b_w = tl.where(o_k < K, tl.exp(b_f - mx) / denom, 0.0)
    else:
        b_p = b_p / denom
        b_p = tl.where(m_e, b_p, -1.0)  # below every probability: never picked
        b_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        b_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
        for j in range(K):
            # the largest and where it is in one reduction (tl.argmax is this call's index; a separate
            # tl.max reduced again: 10 rounds of shuffles a token more)
            top, best = tl.max(b_p, axis=0, return_indices=True, return_indices_tie_break_left=True)
            b_w = tl.where(o_k == j, top, b_w)
            b_i = tl.where(o_k == j, best.to(tl.int64), b_i)
            b_p = tl.where(o_e == best, -1.0, b_p)
    if NORMALIZE:
        b_w = b_w / tl.sum(b_w, axis=0)
    if SHARED_GATE:  # column E: the shared expert's gate logit; its weight goes after the k routed ones
        gate = tl.load(p_logits + i_t * stride_lt + E).to(tl.float32)
        b_w = tl.where(o_k == K, 1.0 / (1.0 + tl.exp(-gate)), b_w)
    m_k = o_k < K
    tl.store(p_w + i_t * stride_wt + o_k, b_w.to(p_w.dtype.element_ty), mask=o_k < K + SHARED_GATE)
    if not FORCED:
        tl.store(p_ids + i_t * stride_it + o_k, b_i, mask=m_k)
    if HAS_TABLE:  # each expert's slot, looked up here rather than by a gather launch
        tl.store(p_slots + i_t * stride_st + o_k, tl.load(p_table + b_i, mask=m_k, other=-1).to(tl.int32), mask=m_k)
    return tl.where(m_k, b_i, 0)


def route_outputs(t: int, top_k: int, shared_gate: bool, dtype: torch.dtype, device: torch.device,
                  slot_table: torch.Tensor | None, forced: torch.Tensor | None):
    """The routing launches' outputs: (weights [t, k + S] in dtype, ids [t, k] int64 (`forced` itself when
    given, checked), slots [t, k] int32 or None without a table)."""
    w = torch.empty((t, top_k + int(shared_gate)), dtype=dtype, device=device)
    if forced is not None:
        if tuple(forced.shape) != (t, top_k) or forced.dtype != torch.int64:
            raise ValueError(f"forced experts must be int64 [{t}, {top_k}], got {forced.dtype} {tuple(forced.shape)}")
        ids = forced if forced.stride(-1) == 1 else forced.contiguous()
    else:
        ids = torch.empty((t, top_k), dtype=torch.int64, device=device)
    slots = None if slot_table is None else torch.empty((t, top_k), dtype=torch.int32, device=device)
    return w, ids, slots


def router_topk_triton(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits' dtype, ids [T, k] int64), as `router_topk_ref`.

    Raises: ValueError for k outside 1..E or E above 8192 (one tile per token)."""
    r = route_triton(logits, top_k, normalize)
    return r[0], r[1]


def route_triton(logits: torch.Tensor, top_k: int, normalize: bool, *, shared_gate: bool = False,
                 slot_table: torch.Tensor | None = None, num_warps: int | None = None,
                 forced: torch.Tensor | None = None):
    """`ft.kernels.router.route` in one launch: (weights [T, k + S], ids [T, k] int64, slots [T, k]
    int32 or None); S = 1 with `shared_gate` (logits' last column is then the shared gate's).
    With `forced` [T, k] (int64 expert ids) those are the experts (returned as ids, not copied)
    and the weights are the softmax at them, as `route_forced_ref`.

    Raises: ValueError for k outside 1..E or E above 8192 (one tile per token)."""
    t, e = logits.shape[0], logits.shape[1] - int(shared_gate)
    if not 1 <= top_k <= e or e > 8192:
        raise ValueError(f"router top-k needs 1 <= k <= E <= 8192, got k={top_k}, E={e}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    dev = logits.device
    w, ids, slots = route_outputs(t, top_k, shared_gate, logits.dtype, dev, slot_table, forced)
    if t:
        table = ids if slot_table is None else slot_table  # any pointer when there is no table (never read)
        out_slots = ids if slots is None else slots
        _router_topk_kernel[(t,)](logits, w, ids, table, out_slots, e, top_k, logits.stride(0), w.stride(0),
                                  ids.stride(0), out_slots.stride(0), NORMALIZE=normalize,
                                  BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k + 1),
                                  SHARED_GATE=shared_gate, HAS_TABLE=slot_table is not None, FORCED=forced is not None,
                                  num_warps=num_warps or router_warps(e), **pdl_args(dev))
    return w, ids, slots
