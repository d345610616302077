"""Triton expert lookup (details module of `ft.kernels.expert_lookup`): one program per token.

A program reads its row's k expert ids, looks up their slots, stamps last_use, counts hits and misses, and
lets each miss claim its expert for this step with an atomic max on claim[e] (the one program that
sees an older step wins, so an expert is claimed once per step however many rows route to it);
the winners of a program take consecutive landing slots with one atomic add on landing_used.
Rows race for the order of claims, so which landing slot an expert gets may differ from run to run;
what is computed does not (a pair reads the same bytes from its slot or from the host store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["commit_landed_triton", "expert_lookup_triton"]


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
    """`ft.kernels.expert_lookup.expert_lookup_ref` in one launch (T programs)."""
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
def _commit_landed_kernel(p_table, p_landing, p_used, p_landed, stride_tl, stride_ll, R, BLOCK_R: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_l = tl.program_id(0)
    o_r = tl.arange(0, BLOCK_R)
    n = tl.load(p_used + i_l)
    b_s = tl.load(p_landing + i_l * stride_ll + o_r, mask=o_r < R, other=-1)
    ok = (o_r < n) & (b_s >= 0)
    b_e = tl.load(p_landed + i_l * stride_ll + o_r, mask=ok, other=0)
    tl.store(p_table + i_l * stride_tl + b_e, b_s.to(p_table.dtype.element_ty), mask=ok)


def commit_landed_triton(slot_table: torch.Tensor, book) -> None:
    """`ft.kernels.expert_lookup.commit_landed_ref` in one launch (a program per layer)."""
    layers, r = book.landing.shape
    assert book.landed.stride() == book.landing.stride() and slot_table.stride(1) == 1
    _commit_landed_kernel[(layers,)](
        slot_table, book.landing, book.landing_used, book.landed, slot_table.stride(0), book.landing.stride(0), r,
        BLOCK_R=triton.next_power_of_2(r), num_warps=1, **pdl_args(slot_table.device))
