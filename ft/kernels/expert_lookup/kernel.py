"""Triton expert lookup (details module of `ft.kernels.expert_lookup`).

Without owners (`expert_lookup_triton`), one program per token: a program reads its row's k expert
ids, looks up their slots, stamps last_use, counts hits and misses, and lets each miss claim its
expert for this step with an atomic max on claim[e] (the one program that sees an older step wins,
so an expert is claimed once per step however many rows route to it); the winners of a program take
consecutive landing slots with one atomic add on landing_used. Rows race for the order of claims, so
which landing slot an expert gets may differ from run to run; what is computed does not (a pair
reads the same bytes from its slot or from the host store).

With owners (`expert_lookup_owned_triton`: the landing slots may still hold their victims), one
program for all the layer's pairs, since a slot may be claimed only once every row's use is
stamped: stamps, then the claimable slots in order (owner not used this step) into the book's
scratch, then each expert's first miss in row order (an atomic min of the pair's index), then the
claims in that order: the reference's result exactly, in five phases separated by barriers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait
from ft.kernels.router.kernel import route_outputs, route_row, router_warps

__all__ = ["commit_landed_triton", "expert_lookup_owned_triton", "expert_lookup_triton", "route_lookup_owned_triton"]


@triton.jit
def _expert_lookup_kernel(p_ids, p_table, p_step, p_last, p_claim, p_landing, p_used, p_landed, p_counters,
                          p_slots, p_dst, K, R, stride_it, stride_st, stride_dt, BLOCK_K: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t = tl.program_id(0)
    o_k = tl.arange(0, BLOCK_K)
    m_k = o_k < K
    step = tl.load(p_step)
    n_real = tl.load(p_step + 1)
    b_e = tl.load(p_ids + i_t * stride_it + o_k, mask=m_k, other=0)
    b_s = tl.load(p_table + b_e, mask=m_k, other=-1).to(tl.int32)
    m_real = m_k & ((o_k * 0 + i_t) < n_real)  # NOTE: a vector compare (a scalar one is no mask here)
    tl.store(p_last + b_e, tl.zeros((BLOCK_K,), dtype=tl.int32) + step, mask=m_real)
    miss = m_real & (b_s < 0)
    n_miss = tl.sum(miss.to(tl.int64), axis=0)
    tl.atomic_add(p_counters, tl.sum(m_real.to(tl.int64), axis=0) - n_miss)
    tl.atomic_add(p_counters + 1, n_miss)
    # NOTE: ids are distinct within a row, so a row's atomics never collide with each other
    old = tl.atomic_max(p_claim + b_e, tl.zeros((BLOCK_K,), dtype=tl.int32) + step, mask=miss)
    first = miss & (old < step)
    n_first = tl.sum(first.to(tl.int32), axis=0)
    base = tl.atomic_add(p_used, n_first)
    i_l = base + tl.cumsum(first.to(tl.int32), axis=0) - 1
    ok = first & (i_l < R)
    b_d = tl.load(p_landing + i_l, mask=ok, other=-1)
    tl.store(p_landed + i_l, b_e.to(tl.int32), mask=ok & (b_d >= 0))
    tl.store(p_slots + i_t * stride_st + o_k, b_s, mask=m_k)
    tl.store(p_dst + i_t * stride_dt + o_k, tl.where(ok, b_d, -1), mask=m_k)


def expert_lookup_triton(ids: torch.Tensor, slot_table: torch.Tensor, book, layer: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`ft.kernels.expert_lookup.expert_lookup_ref` in one launch (T programs), for a book without
    owners (victims unmapped before the step)."""
    slot_table = slot_table[layer]
    t, k = ids.shape
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    slots = torch.empty((t, k), dtype=torch.int32, device=ids.device)
    dst = torch.empty((t, k), dtype=torch.int32, device=ids.device)
    if t:
        _expert_lookup_kernel[(t,)](
            ids, slot_table, book.step, book.last_use[layer], book.claim[layer],
            book.landing[layer], book.landing_used[layer:], book.landed[layer], book.counters[layer], slots, dst,
            k, book.landing.shape[1], ids.stride(0), slots.stride(0), dst.stride(0),
            BLOCK_K=triton.next_power_of_2(k), num_warps=1, **pdl_args(ids.device))
    return slots, dst


@triton.jit
def _expert_lookup_owned_kernel(p_ids, p_table, p_step, p_last, p_claim, p_landing, p_owner, p_used, p_landed,
                                p_counters, p_order, p_slots, p_dst, layer_base, T, K, R, stride_it, stride_st,
                                stride_dt, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    # p_table, p_last: the [L, E] tensors' bases (owners are flat indices into every layer's row;
    # this layer's row starts at layer_base); the other book pointers: this layer's rows
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    o_n = tl.arange(0, BLOCK_N)
    t = o_n // K
    m_n = o_n < T * K
    b_e = tl.load(p_ids + t * stride_it + o_n % K, mask=m_n, other=0)
    _lookup_owned_pairs(b_e, o_n, t, m_n, p_table, p_step, p_last, p_claim, p_landing, p_owner, p_used, p_landed,
                        p_counters, p_order, p_slots, p_dst, layer_base, K, R, stride_st, stride_dt, BLOCK_N, BLOCK_R)


@triton.jit
def _lookup_owned_pairs(b_e, o_n, t, m_n, p_table, p_step, p_last, p_claim, p_landing, p_owner, p_used, p_landed,
                        p_counters, p_order, p_slots, p_dst, layer_base, K, R, stride_st, stride_dt,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The owned lookup's phases over one program's pairs: b_e [BLOCK_N] their experts, o_n the pair indices
    (row-major, t = o_n // K their rows), m_n the pairs that exist (`_expert_lookup_owned_kernel`, and
    `_route_lookup_owned_kernel`'s one token)."""
    step = tl.load(p_step)
    n_real = tl.load(p_step + 1)
    # phase 1: slots, use stamps, counts; each missed expert's claim word reset
    b_f = layer_base + b_e  # the flat index of the pair's expert
    b_s = tl.load(p_table + b_f, mask=m_n, other=-1).to(tl.int32)
    real = m_n & (t < n_real)
    tl.store(p_last + b_f, tl.zeros((BLOCK_N,), dtype=tl.int32) + step, mask=real)
    miss = real & (b_s < 0)
    n_miss = tl.sum(miss.to(tl.int64), axis=0)
    tl.store(p_counters, tl.load(p_counters) + tl.sum(real.to(tl.int64), axis=0) - n_miss)
    tl.store(p_counters + 1, tl.load(p_counters + 1) + n_miss)
    tl.store(p_claim + b_e, tl.full((BLOCK_N,), 2147483647, tl.int32), mask=miss)  # (an expert's pairs: one value)
    tl.debug_barrier()
    # phase 2: the claimable landing slots in order (no owner, or one no real row used this step so
    # far) into the scratch; each missed expert's first pair in row order (the least pair index)
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    b_o = tl.load(p_owner + o_r, mask=m_r, other=-1)
    # (volatile: written in this launch by other threads; read past L1)
    b_lu = tl.load(p_last + b_o, mask=m_r & (b_o >= 0), other=-1, volatile=True)
    claimable = m_r & (b_lu < step)
    rank = tl.cumsum(claimable.to(tl.int32), axis=0) - 1
    tl.store(p_order + rank, o_r, mask=claimable)
    n_claimable = tl.sum(claimable.to(tl.int32), axis=0)
    tl.atomic_min(p_claim + b_e, o_n, mask=miss)
    tl.debug_barrier()
    # phase 3: the first pairs known; the claim words get the reference's stamp
    first = miss & (tl.load(p_claim + b_e, mask=miss, other=-1, volatile=True) == o_n)
    tl.debug_barrier()
    tl.store(p_claim + b_e, tl.zeros((BLOCK_N,), dtype=tl.int32) + step, mask=miss)
    # phase 4: the c-th first miss takes the c-th claimable slot, and unmaps the victim it held
    c = tl.cumsum(first.to(tl.int32), axis=0) - 1
    tl.store(p_used, tl.load(p_used) + tl.sum(first.to(tl.int32), axis=0))
    ok = first & (c < n_claimable)
    i = tl.load(p_order + c, mask=ok, other=0, volatile=True)
    b_d = tl.load(p_landing + i, mask=ok, other=-1)
    ok = ok & (b_d >= 0)
    tl.store(p_landed + i, b_e.to(tl.int32), mask=ok)
    b_v = tl.load(p_owner + i, mask=ok, other=-1)
    tl.store(p_table + b_v, tl.full((BLOCK_N,), -1, p_table.dtype.element_ty), mask=ok & (b_v >= 0))
    tl.store(p_slots + t * stride_st + o_n % K, b_s, mask=m_n)
    tl.store(p_dst + t * stride_dt + o_n % K, tl.where(ok, b_d, -1), mask=m_n)


@triton.jit
def _route_lookup_owned_kernel(p_logits, p_w, p_ids, p_table_row, p_rslots, E, K, stride_lt, stride_wt, stride_it,
                               p_table, p_step, p_last, p_claim, p_landing, p_owner, p_used, p_landed, p_counters,
                               p_order, p_slots, p_dst, layer_base, R, stride_st, stride_dt,
                               NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                               SHARED_GATE: tl.constexpr, FORCED: tl.constexpr, BLOCK_R: tl.constexpr,
                               PDL: tl.constexpr = False):
    """One token's routing (`route_row`) and its owned lookup (`_lookup_owned_pairs`) in one program: the
    ids stay in registers between them (one launch a MoE layer instead of two)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    b_e = route_row(p_logits, p_w, p_ids, p_table_row, p_rslots, 0, E, K, stride_lt, stride_wt, stride_it, 0,
                    NORMALIZE, BLOCK_E, BLOCK_K, SHARED_GATE, False, FORCED)
    o_n = tl.arange(0, BLOCK_K)
    _lookup_owned_pairs(b_e, o_n, o_n * 0, o_n < K, p_table, p_step, p_last, p_claim, p_landing, p_owner, p_used,
                        p_landed, p_counters, p_order, p_slots, p_dst, layer_base, K, R, stride_st, stride_dt,
                        BLOCK_K, BLOCK_R)


def route_lookup_owned_triton(logits: torch.Tensor, top_k: int, normalize: bool, slot_table: torch.Tensor, book,
                              layer: int, *, shared_gate: bool = False, forced: torch.Tensor | None = None):
    """One token's `route_triton` and `expert_lookup_owned_triton` in one launch of one program: (weights
    [1, k + S], ids [1, k] int64, slots [1, k] int32, dst [1, k] int32), the book updated as the two would.

    Raises: ValueError for more than one token, k outside 1..E or E above 8192."""
    t, e = logits.shape[0], logits.shape[1] - int(shared_gate)
    if t != 1 or not 1 <= top_k <= e or e > 8192:
        raise ValueError(f"the fused route and lookup takes one token and 1 <= k <= E <= 8192, got T={t}, k={top_k}, "
                         f"E={e}")
    assert slot_table.is_contiguous() and book.last_use.is_contiguous() and slot_table.shape == book.last_use.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    dev = logits.device
    w, ids, _ = route_outputs(1, top_k, shared_gate, logits.dtype, dev, None, forced)
    slots = torch.empty((1, top_k), dtype=torch.int32, device=dev)
    dst = torch.empty((1, top_k), dtype=torch.int32, device=dev)
    r = book.landing.shape[1]
    _route_lookup_owned_kernel[(1,)](
        # (ids for the routing's slot-table pointers: unread, HAS_TABLE is off)
        logits, w, ids, ids, ids, e, top_k, logits.stride(0), w.stride(0), ids.stride(0),
        slot_table, book.step, book.last_use, book.claim[layer], book.landing[layer], book.owner[layer],
        book.landing_used[layer:], book.landed[layer], book.counters[layer], book.order[layer], slots, dst,
        layer * slot_table.shape[1], r, slots.stride(0), dst.stride(0),
        NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(top_k + 1),
        SHARED_GATE=shared_gate, FORCED=forced is not None, BLOCK_R=triton.next_power_of_2(r),
        num_warps=router_warps(e), **pdl_args(dev))
    return w, ids, slots, dst


def expert_lookup_owned_triton(ids: torch.Tensor, slot_table: torch.Tensor, book, layer: int
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`ft.kernels.expert_lookup.expert_lookup_ref` in one launch of one program (`slot_table` [L, E];
    the book may hold owners)."""
    t, k = ids.shape
    ids = ids if ids.stride(-1) == 1 else ids.contiguous()
    slots = torch.empty((t, k), dtype=torch.int32, device=ids.device)
    dst = torch.empty((t, k), dtype=torch.int32, device=ids.device)
    assert slot_table.is_contiguous() and book.last_use.is_contiguous() and slot_table.shape == book.last_use.shape
    if t:
        r = book.landing.shape[1]
        n = triton.next_power_of_2(t * k)
        _expert_lookup_owned_kernel[(1,)](
            ids, slot_table, book.step, book.last_use, book.claim[layer], book.landing[layer], book.owner[layer],
            book.landing_used[layer:], book.landed[layer], book.counters[layer], book.order[layer], slots, dst,
            layer * slot_table.shape[1], t, k, r, ids.stride(0), slots.stride(0), dst.stride(0),
            BLOCK_N=n, BLOCK_R=triton.next_power_of_2(r), num_warps=max(1, min(8, n // 128)),
            **pdl_args(ids.device))
    return slots, dst


@triton.jit
def _commit_landed_kernel(p_table, p_landing, p_landed, stride_tl, stride_ll, R, BLOCK_R: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_l = tl.program_id(0)
    o_r = tl.arange(0, BLOCK_R)
    b_s = tl.load(p_landing + i_l * stride_ll + o_r, mask=o_r < R, other=-1)
    b_e = tl.load(p_landed + i_l * stride_ll + o_r, mask=o_r < R, other=-1)
    ok = (b_e >= 0) & (b_s >= 0)
    tl.store(p_table + i_l * stride_tl + b_e, b_s.to(p_table.dtype.element_ty), mask=ok)


def commit_landed_triton(slot_table: torch.Tensor, book) -> None:
    """`ft.kernels.expert_lookup.commit_landed_ref` in one launch (a program per layer)."""
    layers, r = book.landing.shape
    assert book.landed.stride() == book.landing.stride() and slot_table.stride(1) == 1
    _commit_landed_kernel[(layers,)](
        slot_table, book.landing, book.landed, slot_table.stride(0), book.landing.stride(0), r,
        BLOCK_R=triton.next_power_of_2(r), num_warps=1, **pdl_args(slot_table.device))
