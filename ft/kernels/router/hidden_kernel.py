"""The MoE block's routing from its hidden state in one launch (details module of `ft.kernels.router`):
the router's logits by the dense decode GEMV, then softmax, top-k and the rest of `route` by the last
program to finish.

`_route_hidden_kernel`, grid (cdiv(E + S, BLOCK_N), cdiv(M, BLOCK_M)), the dense GEMV's grid and tiles
(`ft.kernels.dense.kernel`): each program computes its BLOCK_N logits of BLOCK_M tokens and stores them
(fp32, into a [M, E + S] scratch), then counts itself done on its token block's counter (an atomic
add, acquire-release at GPU scope, after a barrier so that all the program's stores come first). The
program that counts last has every logit of the block visible: it routes the block's BLOCK_M tokens
as one [BLOCK_M, BLOCK_E] tile (softmax, k rounds of argmax with ties to the lowest expert, the
renormalisation, the shared gate's sigmoid, the slot lookup or the given experts' weights), then
puts the counter back to zero for the next launch (a CUDA graph replays the same counters).

What it saves: the separate top-k launch after the GEMV (`_router_topk_kernel`: a node of the decode
graph per MoE layer, 48 a step); its cost: the routing runs in one program per token block at the
end of the GEMV instead of one warp per token. Not yet timed on a GPU.

Rounding: the logits are the GEMV's fp32 sums rounded to x's dtype as `dense_linear` rounds them, so
each logit has the GEMV's bits; the softmax's sums run in another order than the one-token kernel's,
so weights agree with `route` to the last bits of fp32 before their rounding to x's dtype.
The counters ([cdiv(M, BLOCK_M)] int32, zero between launches) are the caller's, one set for each
call site that may run while another is in flight; this module never allocates them (an allocation
and a memset per call would be two more launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.dense.kernel import default_config, gemv_block, k_tiling
from ft.kernels.router.kernel import route_outputs

__all__ = ["MAX_TOKENS", "route_hidden_triton"]

MAX_TOKENS = 16
"""Tokens per call at most (the dense GEMV's `MAX_M`); the counters hold one int32 per block of tokens."""


@triton.jit
def _route_hidden_kernel(p_x, p_w, p_l, p_count, p_wt, p_ids, p_table, p_slots, M, N, K, E, TOPK,
                         stride_xm, stride_wn, stride_wtt, stride_it, stride_st,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         ONE_TILE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                         NORMALIZE: tl.constexpr, SHARED_GATE: tl.constexpr, HAS_TABLE: tl.constexpr,
                         FORCED: tl.constexpr):
    i_n = tl.program_id(0)
    i_m = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = gemv_block(p_x, p_w, M, N, K, stride_xm, stride_wn, i_m, i_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, ONE_TILE,
                     False)
    # the logits as dense_linear rounds them (x's dtype), kept in fp32 scratch
    b_lg = acc.to(p_x.dtype.element_ty).to(tl.float32)
    tl.store(p_l + o_m.to(tl.int64)[:, None] * N + o_n[None, :], b_lg, mask=(o_m < M)[:, None] & (o_n < N)[None, :])
    tl.debug_barrier()  # every thread's stores before the count
    done = tl.atomic_add(p_count + i_m, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:  # the block's last program: every logit of its tokens is stored
        o_e = tl.arange(0, BLOCK_E)
        m_e = o_e < E
        m_t = o_m < M
        p_rows = p_l + tl.minimum(o_m, M - 1).to(tl.int64)[:, None] * N
        b_l = tl.load(p_rows + o_e[None, :], mask=m_e[None, :], other=float("-inf"), cache_modifier=".cg")
        mx = tl.max(b_l, axis=1)
        b_p = tl.exp(b_l - mx[:, None])
        denom = tl.sum(b_p, axis=1)
        o_j = tl.arange(0, BLOCK_TOPK)
        if FORCED:  # the experts are given (p_ids holds them); weights = the softmax at them
            m_j = o_j < TOPK
            b_i = tl.load(p_ids + o_m.to(tl.int64)[:, None] * stride_it + o_j[None, :],
                          mask=m_t[:, None] & m_j[None, :], other=0)
            b_f = tl.load(p_rows + b_i, mask=m_j[None, :], other=float("-inf"), cache_modifier=".cg")
            b_wt = tl.where(m_j[None, :], tl.exp(b_f - mx[:, None]) / denom[:, None], 0.0)
        else:
            b_p = tl.where(m_e[None, :], b_p / denom[:, None], -1.0)  # below every probability: never picked
            b_wt = tl.zeros((BLOCK_M, BLOCK_TOPK), dtype=tl.float32)
            b_i = tl.zeros((BLOCK_M, BLOCK_TOPK), dtype=tl.int64)
            for j in range(TOPK):
                best = tl.argmax(b_p, axis=1)
                b_wt = tl.where(o_j[None, :] == j, tl.max(b_p, axis=1)[:, None], b_wt)
                b_i = tl.where(o_j[None, :] == j, best.to(tl.int64)[:, None], b_i)
                b_p = tl.where(o_e[None, :] == best[:, None], -1.0, b_p)
        if NORMALIZE:
            b_wt = b_wt / tl.sum(b_wt, axis=1)[:, None]
        if SHARED_GATE:  # column E: the shared expert's gate logit; its weight follows the k routed ones
            gate = tl.load(p_l + tl.minimum(o_m, M - 1).to(tl.int64) * N + E, cache_modifier=".cg")
            b_wt = tl.where(o_j[None, :] == TOPK, (1.0 / (1.0 + tl.exp(-gate)))[:, None], b_wt)
        m_k = m_t[:, None] & (o_j < TOPK)[None, :]
        tl.store(p_wt + o_m.to(tl.int64)[:, None] * stride_wtt + o_j[None, :], b_wt.to(p_wt.dtype.element_ty),
                 mask=m_t[:, None] & (o_j < TOPK + SHARED_GATE)[None, :])
        if not FORCED:
            tl.store(p_ids + o_m.to(tl.int64)[:, None] * stride_it + o_j[None, :], b_i, mask=m_k)
        if HAS_TABLE:
            b_s = tl.load(p_table + b_i, mask=m_k, other=-1).to(tl.int32)
            tl.store(p_slots + o_m.to(tl.int64)[:, None] * stride_st + o_j[None, :], b_s, mask=m_k)
        tl.atomic_xchg(p_count + i_m, 0, sem="relaxed", scope="gpu")  # zero for the next launch


def route_hidden_triton(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool, counters: torch.Tensor, *,
                        shared_gate: bool = False, slot_table: torch.Tensor | None = None,
                        forced: torch.Tensor | None = None):
    """`ft.kernels.router.route_hidden` in one launch: x [M, K] (M <= `MAX_TOKENS`), weight [E + S, K]
    dense in x's dtype (S = 1 with `shared_gate`: the last row is the shared gate's), counters int32
    [>= cdiv(M, BLOCK_M)] on x's device, zero (and left zero) -> (weights [M, k + S] in x's dtype, ids
    [M, k] int64, slots [M, k] int32 or None), as `route(dense_linear(x, weight), ...)`.

    Raises: ValueError for shapes the kernel does not take."""
    m, kdim = x.shape
    n = weight.shape[0]
    e = n - int(shared_gate)
    if not 1 <= m <= MAX_TOKENS or not 1 <= top_k <= e or e > 8192 or weight.shape[1] != kdim:
        raise ValueError(f"route_hidden takes 1..{MAX_TOKENS} tokens, 1 <= k <= E <= 8192 and a weight of x's width; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}, k={top_k}")
    cfg = dict(default_config(m, n, kdim, x.dtype))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
    if counters.dtype != torch.int32 or counters.numel() < grid[1] or counters.device != x.device:
        raise ValueError(f"counters must be int32 [>= {grid[1]}] on {x.device}, got {counters.dtype} "
                         f"{tuple(counters.shape)} on {counters.device}")
    dev = x.device
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    logits = torch.empty((m, n), dtype=torch.float32, device=dev)  # scratch: read by the last programs only
    w, ids, slots = route_outputs(m, top_k, shared_gate, x.dtype, dev, slot_table, forced)
    table = ids if slot_table is None else slot_table
    out_slots = ids if slots is None else slots
    _route_hidden_kernel[grid](x, weight, logits, counters, w, ids, table, out_slots, m, n, kdim, e, top_k,
                               x.stride(0), weight.stride(0), w.stride(0), ids.stride(0), out_slots.stride(0),
                               **k_tiling(kdim, cfg["BLOCK_K"]), **cfg, BLOCK_E=triton.next_power_of_2(e),
                               BLOCK_TOPK=triton.next_power_of_2(top_k + 1), NORMALIZE=normalize,
                               SHARED_GATE=shared_gate, HAS_TABLE=slot_table is not None, FORCED=forced is not None)
    return w, ids, slots
