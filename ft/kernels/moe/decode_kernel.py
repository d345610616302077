"""Triton kernels of the decode MoE block (details module of `ft.kernels.moe`): routed pairs and
the layer's shared expert in one ordered fp32 sum, optionally followed by the next layer's input
norm; what `ft.model.layers.moe.SparseMoE` runs for up to `DECODE_MAX_TOKENS` tokens.

Three launches: `_moe_decode_gate_up_kernel` (per pair, the shared expert as pair k of each token,
chosen by pointer), `_moe_decode_down_pairs_kernel` (per pair, weighted; `_moe_decode_down_kernel`
loops over a token's pairs instead) and the sum (`kernel.moe_sum_pairs_kernel`, or
`_moe_sum_add_norm_kernel` with the residual add and the next input norm). Weights are read in
the slot pool's layout with `ft.kernels.nvfp4.kernel`'s row dot products; no host sync anywhere.
Pairs without a slot may read their expert from the host store in place and, with `topk_dst`, land
the bytes they read in a free slot of the pool as they go (the read-through landing store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

from ft.kernels.options import kernel_options
from ft.kernels.backend import inline_ptx
from ft.kernels.moe.decode_tiles import DECODE_DOWN_MIN_BLOCK_H
from ft.kernels.moe.kernel import moe_sum_pairs_kernel
from ft.kernels.norm.kernel import rms_rstd, norm_warps, add_rms_norm_triton
from ft.kernels.limits import whole_k_pieces
from ft.kernels.nvfp4.kernel import as_words, half_sums_take
from ft.kernels.nvfp4.rows import (dot_whole_k, load_whole_k, store_whole_k, x_lanes, nvfp4_rows_dot,
                                  rows_dot_whole_k)

__all__ = ["down_pairs_config", "moe_decode_triton"]

# (rows, BLOCK_W words or 0 for the whole K, num_warps) of the decode MoE's passes (`moe_decode_triton`:
# gate/up per pair; down looping over a token's pairs and summing them), for one token and for
# more; the H200 sweep's best (bench/moe_decode.py --sweep, bench/RESULTS.md)
DECODE_GATE_UP_CONFIG = {1: (4, 0, 4), 2: (8, 0, 4)}
# Down per pair (`_moe_decode_down_pairs_kernel`: BLOCK_H rows, whole K, `MoeOptions.decode_down_warps`; see
# `down_pairs_config`) plus an ordered sum over each token's pairs: the best of the sweep at batch 1 and 8 (17.5
# and 74.6 us for the block against 20.2 and 75.9 for one program per token looping over its pairs, which
# `DECODE_DOWN_CONFIG` configures and `down_per_pair=False` or a K that is not one tile selects).
DECODE_DOWN_CONFIG = {1: (8, 0, 4), 2: (8, 0, 2)}
DECODE_DOWN_PAIRS_MIN_TOKENS = 1


def down_pairs_config(intermediate: int | None = None) -> tuple[int, int, int]:
    """The per-pair down pass's tile from two tokens: (BLOCK_H, 0 = the whole K, warps). Where the
    intermediate size (the pass's K) is two whole-K tiles (`limits.whole_k_pieces`: Flash-Next's 640 = 64 + 16
    words), `MoeOptions.decode_down_two_tiles`' rows and warps when set; else `decode_down_rows` and
    `decode_down_warps`.

    Raises: ValueError for rows under `decode_tiles.DECODE_DOWN_MIN_BLOCK_H` (the sum counters' sizing) or not
    a power of two."""
    opts = kernel_options().moe
    two_tiles = opts.decode_down_two_tiles if intermediate and whole_k_pieces(intermediate)[1] else None
    rows, warps = two_tiles or (opts.decode_down_rows, opts.decode_down_warps)
    if rows < DECODE_DOWN_MIN_BLOCK_H or rows & (rows - 1):
        raise ValueError(f"the decode MoE's down rows must be a power of two >= {DECODE_DOWN_MIN_BLOCK_H}, got {rows} "
                         "(MoeOptions.decode_down_rows / decode_down_two_tiles)")
    return rows, 0, warps


@triton.jit
def _padding_skip(p_live, i_t, from_host, p_dst_pair, routed, HAS_DST: tl.constexpr):
    """(dead, skip) for a pair of token t: dead when p_live[t] < 0 (a padding token); skip when dead and,
    with HAS_DST, the pair lands nothing (it reads from the host store with a dst slot >= 0 at
    p_dst_pair: that pair must run whole, so that the slot gets the expert)."""
    dead = tl.load(p_live + i_t) < 0
    skip = dead
    if HAS_DST:
        lands = from_host & (tl.load(p_dst_pair, mask=routed, other=-1) >= 0)
        skip = dead & (lands == 0)
    return dead, skip


@triton.jit
def _pair_source(p_slots, p_ids, p_dst, i_t, j, stride_st, stride_it, stride_dt, TOPK: tl.constexpr,
                 HAS_HOST: tl.constexpr, HAS_DST: tl.constexpr):
    """Where pair j of token t reads its expert: (is_shared, slot, eid, from_host, on, dst, land). j = TOPK is
    the shared expert; a routed pair reads slot topk_slots[t, j], or with HAS_HOST and no slot (-1) expert
    topk_ids[t, j] from the host store (from_host); on: the pair computes. HAS_DST: such a pair lands what it
    reads in slot topk_dst[t, j] when that is >= 0 (land; else dst 0, land False). slot, eid, dst int64 >= 0."""
    is_shared = j >= TOPK
    slot = tl.load(p_slots + i_t * stride_st + j, mask=j < TOPK, other=0)
    eid = tl.load(p_ids + i_t * stride_it + j, mask=HAS_HOST & (j < TOPK), other=-1)  # ids: only with a host store
    from_host = (slot < 0) & (eid >= 0)
    on = (slot >= 0) | is_shared | from_host
    slot = tl.maximum(slot, 0).to(tl.int64)
    eid = tl.maximum(eid, 0).to(tl.int64)
    dst = tl.zeros((), dtype=tl.int64)
    land = from_host & False
    if HAS_DST:  # (a constexpr branch: the path without it compiles as before)
        d = tl.load(p_dst + i_t * stride_dt + j, mask=j < TOPK, other=-1)
        land = from_host & (d >= 0)
        dst = tl.maximum(d, 0).to(tl.int64)
    return is_shared, slot, eid, from_host, on, dst, land


@triton.jit
def _moe_decode_gate_up_kernel(
    p_x, p_slots, p_ids, p_dst, p_w13, p_s13, p_s2, p_sw13, p_ss13, p_ss2, p_hw13, p_hs13, p_hs2, p_h, p_live,
    I, H,
    stride_xt, stride_st, stride_it, stride_dt, stride_w13e, stride_w13r, stride_s13e, stride_s13r, stride_s2e,
    stride_hw13e, stride_hs13e, stride_hs2e, stride_ht,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr,
    WHOLE_K: tl.constexpr = 0, HAS_HOST: tl.constexpr = False, HAS_DST: tl.constexpr = False,
    ASM: tl.constexpr = False,
    PDL: tl.constexpr = False, WHOLE_K2: tl.constexpr = 0, HAS_LIVE: tl.constexpr = False,
    HALF: tl.constexpr = False,
):
    """Grid (T * KS, I / BLOCK_I), KS = TOPK + HAS_SHARED: h[t * KS + j] = silu(x[t] @ gate^T) * (x[t] @ up^T)
    (fp32) of pair j of token t: the expert in slot topk_slots[t, j] for j < TOPK, the shared expert
    (its own one-slot pool at p_sw13, p_ss13, p_ss2; same row strides) for j = TOPK. A pair without
    a slot (-1) reads its expert topk_ids[t, j] from the layer's host store (p_hw13, ...: pinned
    memory that the GPU reads directly, same row strides) with HAS_HOST, else it is skipped: it
    reads no weights and stores zeros.
    HAS_DST (with HAS_HOST and WHOLE_K): a pair read from the host store with d = topk_dst[t, j] >= 0
    also stores the raw bytes it loaded into slot d of the pool (its w13 rows and their block
    scales; the program with i_i = 0 the expert's 3 global scales), so the whole grid lands the
    expert's w13, w13_scale and scale_2 in slot d. No pair of the call reads slot d (the caller's
    contract), so the stores race with no load.
    HAS_LIVE: token t is live when p_live[t] >= 0 (a decode step's KV slots: a padding row writes
    nowhere, -1); a dead token's pairs store zeros and return before any weight is read, except a
    pair that lands an expert (HAS_DST), which runs whole so that the slot is filled."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    KS: tl.constexpr = TOPK + HAS_SHARED
    i_p = tl.program_id(0)
    i_i = tl.program_id(1)
    i_t = i_p // KS
    j = i_p % KS
    is_shared, slot, eid, from_host, on, dst, land = _pair_source(p_slots, p_ids, p_dst, i_t, j, stride_st, stride_it,
                                                                  stride_dt, TOPK, HAS_HOST, HAS_DST)
    if HAS_LIVE:  # a padding token: nothing to compute (its output is never read)
        dead, skip = _padding_skip(p_live, i_t, from_host, p_dst + i_t * stride_dt + j, j < TOPK, HAS_DST)
        if skip:
            o_z = i_i * BLOCK_I + tl.arange(0, BLOCK_I)
            tl.store(p_h + i_p * stride_ht + o_z, tl.zeros((BLOCK_I,), dtype=tl.float32), mask=o_z < I)
            return
    # NOTE: the shared expert and the host store are pointer choices, not branches: one code path
    p_w = tl.where(is_shared, p_sw13, tl.where(from_host, p_hw13 + eid * stride_hw13e, p_w13 + slot * stride_w13e))
    p_s = tl.where(is_shared, p_ss13, tl.where(from_host, p_hs13 + eid * stride_hs13e, p_s13 + slot * stride_s13e))
    p_g = tl.where(is_shared, p_ss2, tl.where(from_host, p_hs2 + eid * stride_hs2e, p_s2 + slot * stride_s2e))
    o_q = tl.arange(0, 2 * BLOCK_I)  # tile row 2q + g: gate (g = 0) or up (g = 1) row i_i * BLOCK_I + q
    o_i = i_i * BLOCK_I + o_q // 2
    o_r = o_i + (o_q % 2) * I
    if WHOLE_K > 0:  # H / 8 = WHOLE_K (+ WHOLE_K2) words in one (two) tiles
        # `rows_dot_whole_k` in its parts (x first: x and the weights in flight together), the raw
        # words in between for the landing store
        m_r = o_i < tl.where(on, I, 0)
        x0, x1, x2, x3, x4, x5, x6, x7 = x_lanes(p_x + i_t * stride_xt, WHOLE_K)
        b_w, b_sb = load_whole_k(p_w, p_s, o_r, m_r, stride_w13r, stride_s13r, WHOLE_K)
        if WHOLE_K2 > 0:  # the second tile: words WHOLE_K.., their scale bytes WHOLE_K / 2..
            y0, y1, y2, y3, y4, y5, y6, y7 = x_lanes(p_x + i_t * stride_xt + 8 * WHOLE_K, WHOLE_K2)
            c_w, c_sb = load_whole_k(p_w + WHOLE_K, p_s + WHOLE_K // 2, o_r, m_r, stride_w13r, stride_s13r, WHOLE_K2)
        if HAS_DST:
            m_d = o_i < tl.where(land, I, 0)  # (m_r for a landing pair: land implies on)
            p_dw, p_ds = p_w13 + dst * stride_w13e, p_s13 + dst * stride_s13e
            store_whole_k(p_dw, p_ds, o_r, m_d, stride_w13r, stride_s13r, b_w, b_sb, WHOLE_K)
            if WHOLE_K2 > 0:
                store_whole_k(p_dw + WHOLE_K, p_ds + WHOLE_K // 2, o_r, m_d, stride_w13r, stride_s13r, c_w, c_sb,
                               WHOLE_K2)
            # the expert's global scales (gate, up, down), once per landed expert
            o_3 = tl.arange(0, 4)
            m_3 = o_3 < tl.where(land & (i_i == 0), 3, 0)
            tl.store(p_s2 + dst * stride_s2e + o_3, tl.load(p_g + o_3, mask=m_3, other=0.0), mask=m_3)
        b_gu = dot_whole_k(b_w, b_sb, x0, x1, x2, x3, x4, x5, x6, x7, WHOLE_K, 2 * BLOCK_I, ASM, HALF)
        if WHOLE_K2 > 0:
            b_gu += dot_whole_k(c_w, c_sb, y0, y1, y2, y3, y4, y5, y6, y7, WHOLE_K2, 2 * BLOCK_I, ASM, HALF)
    else:
        tl.static_assert(not HAS_DST, "the landing store takes the whole-K tile")
        o_t = tl.zeros((1,), dtype=tl.int32) + i_t
        b_gu = nvfp4_rows_dot(p_w, p_s, o_r, o_i < I, stride_w13r, stride_s13r, p_x, o_t, o_t >= 0, stride_xt, 0,
                              tl.where(on, H // 8, 0), 1, 2 * BLOCK_I, BLOCK_W)
    b_g, b_u = tl.split(tl.reshape(b_gu, (BLOCK_I, 2)))
    b_g = b_g * tl.load(p_g)
    b_u = b_u * tl.load(p_g + 1)
    b_h = b_g / (1.0 + tl.exp(-b_g)) * b_u
    o_h = i_i * BLOCK_I + tl.arange(0, BLOCK_I)
    if HAS_LIVE:  # (a dead token's landing pair: the expert landed, its h is zeros like the others')
        on = on & (dead == 0)
    tl.store(p_h + i_p * stride_ht + o_h, tl.where(on, b_h, 0.0), mask=o_h < I)


@triton.jit
def _moe_decode_down_kernel(
    p_h, p_slots, p_wts, p_w2, p_s2w, p_s2, p_sw2, p_ss2w, p_ss2, p_out, p_live,
    I, H,
    stride_ht, stride_st, stride_wt, stride_w2e, stride_w2r, stride_s2we, stride_s2wr, stride_s2e, stride_ot,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr,
    WHOLE_K: tl.constexpr = 0, ASM: tl.constexpr = False,
    PDL: tl.constexpr = False, WHOLE_K2: tl.constexpr = 0, HAS_LIVE: tl.constexpr = False, HALF: tl.constexpr = False,
):
    """Grid (T, H / BLOCK_H): out[t] = sum_j wts[t, j] * (h[t * KS + j] @ down_j^T), j = 0 .. KS - 1 in
    order (fp32, cast once): the routed pairs, then the shared expert (j = TOPK, its weight the
    gate's sigmoid). The pairs are unrolled, so all their weight loads are in flight together; the
    fixed order makes the sum independent of slots and of the batch's other tokens. HAS_LIVE: a dead
    token (p_live[t] < 0, as in the gate/up kernel) stores zeros and reads nothing."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    KS: tl.constexpr = TOPK + HAS_SHARED
    i_t = tl.program_id(0)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    if HAS_LIVE:
        if tl.load(p_live + i_t) < 0:
            tl.store(p_out + i_t * stride_ot + o_h, tl.zeros((BLOCK_H,), dtype=p_out.dtype.element_ty), mask=m_h)
            return
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(KS):
        i_p = i_t * KS + j
        if j < TOPK:
            slot = tl.load(p_slots + i_t * stride_st + j)
            on = slot >= 0
            slot = tl.maximum(slot, 0).to(tl.int64)
            p_w = p_w2 + slot * stride_w2e
            p_s = p_s2w + slot * stride_s2we
            p_g = p_s2 + slot * stride_s2e + 2
        else:
            on = i_t >= 0
            p_w = p_sw2
            p_s = p_ss2w
            p_g = p_ss2 + 2
        if WHOLE_K > 0:  # I / 8 = WHOLE_K (+ WHOLE_K2) words in one (two) tiles
            b_y = rows_dot_whole_k(p_w, p_s, o_h, o_h < tl.where(on, H, 0), stride_w2r, stride_s2wr,
                                   p_h + i_p * stride_ht, WHOLE_K, BLOCK_H, ASM, HALF)
            if WHOLE_K2 > 0:
                b_y += rows_dot_whole_k(p_w + WHOLE_K, p_s + WHOLE_K // 2, o_h, o_h < tl.where(on, H, 0), stride_w2r,
                                        stride_s2wr, p_h + i_p * stride_ht + 8 * WHOLE_K, WHOLE_K2, BLOCK_H, ASM, HALF)
        else:
            o_p = tl.zeros((1,), dtype=tl.int32) + i_p
            b_y = tl.sum(nvfp4_rows_dot(p_w, p_s, o_h, m_h, stride_w2r, stride_s2wr, p_h, o_p, o_p >= 0, stride_ht, 0,
                                        tl.where(on, I // 8, 0), 1, BLOCK_H, BLOCK_W), axis=0)
        b_wt = tl.load(p_wts + i_t * stride_wt + j).to(tl.float32) * tl.load(p_g)
        acc += tl.where(on, b_y * b_wt, 0.0)
    tl.store(p_out + i_t * stride_ot + o_h, acc.to(p_out.dtype.element_ty), mask=m_h)


@triton.jit
def _moe_decode_down_pairs_kernel(
    p_h, p_slots, p_ids, p_dst, p_wts, p_w2, p_s2w, p_s2, p_sw2, p_ss2w, p_ss2, p_hw2, p_hs2w, p_hs2, p_yp, p_live,
    I, H,
    stride_ht, stride_st, stride_it, stride_dt, stride_wt, stride_w2e, stride_w2r, stride_s2we, stride_s2wr,
    stride_s2e, stride_hw2e, stride_hs2we, stride_hs2e, stride_yp, p_count, p_y, stride_yt,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, WHOLE_K: tl.constexpr,
    HAS_HOST: tl.constexpr = False, HAS_DST: tl.constexpr = False, ASM: tl.constexpr = False,
    PDL: tl.constexpr = False, WHOLE_K2: tl.constexpr = 0, HAS_LIVE: tl.constexpr = False,
    SUM: tl.constexpr = False, HALF: tl.constexpr = False,
):
    """Grid (T * KS, H / BLOCK_H): yp[p] = wts[t, j] * (h[p] @ down_j^T) (fp32) for pair p = t * KS + j,
    zeros for a skipped pair; `moe_sum_pairs_kernel` then sums each token's KS pairs in order, or with
    SUM this launch does (`_sum_when_last`: the last of a token's KS programs of a column block sums
    the block, counted on p_count[t * H / BLOCK_H + block]).
    With several tokens every pair's expert is in flight at once (`_moe_decode_down_kernel` reads
    a token's pairs in one program). HAS_HOST: a pair without a slot reads the host store, as in
    `_moe_decode_gate_up_kernel`; HAS_DST: such a pair with topk_dst[t, j] = d >= 0 also stores the
    raw w2 rows and block scales it loaded into slot d (the gate/up kernel lands the rest). HAS_LIVE:
    as in the gate/up kernel (a dead token's pairs store zeros; a landing one lands, then stores zeros)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    KS: tl.constexpr = TOPK + HAS_SHARED
    i_p = tl.program_id(0)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i_t = i_p // KS
    j = i_p % KS
    is_shared, slot, eid, from_host, on, dst, land = _pair_source(p_slots, p_ids, p_dst, i_t, j, stride_st, stride_it,
                                                                  stride_dt, TOPK, HAS_HOST, HAS_DST)
    if HAS_LIVE:  # a padding token: nothing to compute (its output is never read)
        dead, skip = _padding_skip(p_live, i_t, from_host, p_dst + i_t * stride_dt + j, j < TOPK, HAS_DST)
        if skip:
            tl.store(p_yp + i_p * stride_yp + o_h, tl.zeros((BLOCK_H,), dtype=tl.float32), mask=o_h < H)
            if SUM:
                _sum_when_last(p_yp, p_count, p_y, i_t, o_h, H, stride_yp, stride_yt, KS, BLOCK_H)
            return
    p_w = tl.where(is_shared, p_sw2, tl.where(from_host, p_hw2 + eid * stride_hw2e, p_w2 + slot * stride_w2e))
    p_s = tl.where(is_shared, p_ss2w, tl.where(from_host, p_hs2w + eid * stride_hs2we, p_s2w + slot * stride_s2we))
    p_g = tl.where(is_shared, p_ss2, tl.where(from_host, p_hs2 + eid * stride_hs2e, p_s2 + slot * stride_s2e))
    # `rows_dot_whole_k` in its parts (h first: h and the weights in flight together), the raw words
    # in between for the landing store
    m_r = o_h < tl.where(on, H, 0)
    x0, x1, x2, x3, x4, x5, x6, x7 = x_lanes(p_h + i_p * stride_ht, WHOLE_K)
    b_w, b_sb = load_whole_k(p_w, p_s, o_h, m_r, stride_w2r, stride_s2wr, WHOLE_K)
    if WHOLE_K2 > 0:  # the second tile: words WHOLE_K.., their scale bytes WHOLE_K / 2..
        y0, y1, y2, y3, y4, y5, y6, y7 = x_lanes(p_h + i_p * stride_ht + 8 * WHOLE_K, WHOLE_K2)
        c_w, c_sb = load_whole_k(p_w + WHOLE_K, p_s + WHOLE_K // 2, o_h, m_r, stride_w2r, stride_s2wr, WHOLE_K2)
    if HAS_DST:
        m_d = o_h < tl.where(land, H, 0)  # (m_r for a landing pair: land implies on)
        p_dw, p_ds = p_w2 + dst * stride_w2e, p_s2w + dst * stride_s2we
        store_whole_k(p_dw, p_ds, o_h, m_d, stride_w2r, stride_s2wr, b_w, b_sb, WHOLE_K)
        if WHOLE_K2 > 0:
            store_whole_k(p_dw + WHOLE_K, p_ds + WHOLE_K // 2, o_h, m_d, stride_w2r, stride_s2wr, c_w, c_sb, WHOLE_K2)
    b_y = dot_whole_k(b_w, b_sb, x0, x1, x2, x3, x4, x5, x6, x7, WHOLE_K, BLOCK_H, ASM, HALF)
    if WHOLE_K2 > 0:
        b_y += dot_whole_k(c_w, c_sb, y0, y1, y2, y3, y4, y5, y6, y7, WHOLE_K2, BLOCK_H, ASM, HALF)
    b_wt = tl.load(p_wts + i_t * stride_wt + j).to(tl.float32) * tl.load(p_g + 2)
    if HAS_LIVE:
        on = on & (dead == 0)
    tl.store(p_yp + i_p * stride_yp + o_h, tl.where(on, b_y * b_wt, 0.0), mask=o_h < H)
    if SUM:
        _sum_when_last(p_yp, p_count, p_y, i_t, o_h, H, stride_yp, stride_yt, KS, BLOCK_H)


@triton.jit
def _sum_when_last(p_yp, p_count, p_y, i_t, o_h, H, stride_yp, stride_yt, KS: tl.constexpr, BLOCK_H: tl.constexpr):
    """After a pair program stored its block of yp: count it on its token's block counter (acquire-release
    at GPU scope, after a barrier so that every thread's stores come first); the program that counts
    the token's KS-th sums the token's KS rows of the block in order in fp32, casts once to y's dtype
    (`moe_sum_pairs_kernel`'s sum: the same bits) and puts the counter back to zero (for the next launch
    or graph replay)."""
    i_c = i_t * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()
    done = tl.atomic_add(p_count + i_c, 1, sem="acq_rel", scope="gpu")
    if done == KS - 1:
        m_h = o_h < H
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in tl.static_range(KS):
            acc += tl.load(p_yp + (i_t * KS + j) * stride_yp + o_h, mask=m_h, other=0.0, cache_modifier=".cg")
        tl.store(p_y + i_t * stride_yt + o_h, acc.to(p_y.dtype.element_ty), mask=m_h)
        tl.atomic_xchg(p_count + i_c, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["H"])
def _moe_sum_add_norm_kernel(p_yp, p_r, p_w, p_x, p_h, H, eps, stride_yp, stride_rt, stride_xt, stride_ht,
                             KS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (T,): y = sum_j yp[t * KS + j] (fp32, in order, cast to the activation dtype), then the
    next layer's input norm with the residual, as `ft.kernels.norm`'s `_rms_norm_kernel` does it:
    h = residual + y (in the activation dtype), x = rmsnorm(h) * (1 + w). Bit for bit the sum kernel
    followed by that kernel, in one launch."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < H
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(KS):  # unrolled: every pair's row in flight at once (one program per token)
        acc += tl.load(p_yp + (i_t * KS + j) * stride_yp + o_d, mask=m_d, other=0.0)
    b_y = acc.to(p_h.dtype.element_ty)
    b_r = tl.load(p_r + i_t * stride_rt + o_d, mask=m_d, other=0.0)
    b_h = (b_r.to(tl.float32) + b_y.to(tl.float32)).to(p_h.dtype.element_ty)
    b_f = b_h.to(tl.float32)
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_x = (b_f * rms_rstd(b_f, H, eps)) * (1.0 + b_w)
    tl.debug_barrier()  # NOTE: every load before any store, so h may be the residual itself
    tl.store(p_h + i_t * stride_ht + o_d, b_h, mask=m_d)
    tl.store(p_x + i_t * stride_xt + o_d, b_x.to(p_x.dtype.element_ty), mask=m_d)


def moe_decode_triton(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w, shared=None, *,
    out: torch.Tensor | None = None, gate_up_config: tuple[int, int, int] | None = None,
    down_config: tuple[int, int, int] | None = None, down_per_pair: bool | None = None,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    host=None, topk_ids: torch.Tensor | None = None, layer: int = 0, topk_dst: torch.Tensor | None = None,
    live: torch.Tensor | None = None, sum_counters: torch.Tensor | None = None,
):
    """The decode MoE block in two or three launches: sum_j weight_j * expert_j(x) over the routed pairs and,
    with `shared`, the shared expert as one more pair.

    Args:
        x: [T, H]; topk_slots: [T, k] integer slots (-1 = skip), any row stride; w: the NVFP4 slot pool.
        topk_weights: [T, k + S] (S = 1 with `shared`): the routing weights, then the shared
            expert's weight (sigmoid of its gate), any row stride.
        shared: None or a one-slot NVFP4 `SlotWeights` with the pool's expert shapes (the shared
            expert of this layer: gate rows, up rows; down).
        out: optional [T, H] in x's dtype.
        down_per_pair: down per pair plus a sum (True) or looping over a token's pairs (False);
            default by T (`DECODE_DOWN_PAIRS_MIN_TOKENS`). *_config override the tuned block sizes.
        residual, norm_weight: with both, the next layer's input norm follows in the same launch as
            the sum (`_moe_sum_add_norm_kernel`): returns (rms_norm(residual + y), residual + y)
            like `ft.kernels.norm.add_rms_norm` (`eps` its epsilon).
        host, topk_ids, layer: the expert cache's host store (`SlotWeights` [L, E, ...], pinned on
            CUDA, where the GPU reads it in place), the routed experts' ids [T, k] and the MoE
            layer: a pair without a slot (-1) then reads its expert from host[layer, id] instead
            of being skipped (no copy before the step; down runs per pair).
        topk_dst: optional [T, k] integer slots (int32 or int64, any row stride, -1 = none), with
            `host` only: the read-through landing store. A pair read from the host store (slot -1,
            id >= 0) with topk_dst[t, j] = d >= 0 also writes the bytes it reads into slot d of `w`,
            so after the call slot d holds exactly host[layer, id] (w13, w2, w13_scale, w2_scale,
            scale_2): the expert is cached without a second read over PCIe. y is bit for bit the
            same as without it. Contract (the caller's, not checked: no host sync): each slot d
            appears at most once in topk_dst, and no pair of the call reads slot d (it is not in
            the slot table while it is being filled). Needs the whole-K tiles of both passes and a
            float32 scale_2 in the pool (written in place).
        live: optional [T] integers (int32 or int64; a decode step's KV slot mapping): a token with a
            negative entry is padding (a CUDA graph's rows past the batch, a row that writes nothing):
            its row of y is zeros and its pairs read no weights (a pair that lands an expert still
            lands it). The live tokens' rows are bit for bit the same as without `live`.
        sum_counters: int32 [>= `ft.kernels.moe.sum_counters_needed(T, H)`] on x's device, zero (and left zero): where
            the per-pair down pass runs, no norm follows and `MoeOptions.decode_sum_in_down` is on, its
            last program of each token's column block sums the block (the same bits as the sum
            kernel, one launch fewer); else unused.
    Returns: y [T, H] in x's dtype: one fp32 sum over the pairs in order, cast once; or the pair above.
    Raises: ValueError on shapes the kernels do not take, or topk_dst without `host`.
    """
    if not w.is_nvfp4 or (shared is not None and not shared.is_nvfp4):
        raise ValueError("moe_decode_triton takes NVFP4 slot pools only")
    t, hid = x.shape
    i = w.w13.shape[1] // 2
    if w.w13.shape[2] * 2 != hid or w.w2.shape[1] != hid or w.w2.shape[2] * 2 != i or i % 16 or hid % 16:
        raise ValueError(f"slot pool shapes {tuple(w.w13.shape)}, {tuple(w.w2.shape)} do not match x {tuple(x.shape)}")
    has_shared = int(shared is not None)
    if has_shared and (shared.w13.shape[1:] != w.w13.shape[1:] or shared.w2.shape[1:] != w.w2.shape[1:]):
        raise ValueError(f"shared expert {tuple(shared.w13.shape)}, {tuple(shared.w2.shape)} does not match the pool's experts")
    k = topk_slots.shape[1]
    has_dst = topk_dst is not None
    if has_dst and host is None:
        raise ValueError("topk_dst (the landing store) needs the host store: pass host=, topk_ids= and layer=")
    if has_dst and (tuple(topk_dst.shape) != (t, k) or topk_dst.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"topk_dst must be int32/int64 [T, k] = [{t}, {k}], got {topk_dst.dtype} "
                         f"{tuple(topk_dst.shape)}")
    if topk_slots.shape[0] != t or tuple(topk_weights.shape) != (t, k + has_shared):
        raise ValueError(f"topk_slots {tuple(topk_slots.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[T, k] and [T, k + {has_shared}]")
    y = torch.empty_like(x) if out is None else out
    if t == 0:
        return (y, torch.empty_like(x)) if residual is not None and norm_weight is not None else y
    x = x if x.stride(-1) == 1 else x.contiguous()
    slots = topk_slots if topk_slots.stride(-1) == 1 else topk_slots.contiguous()
    wts = topk_weights if topk_weights.stride(-1) == 1 else topk_weights.contiguous()
    w13, w2 = as_words(w.w13), as_words(w.w2)
    s13, s2w, s2 = w.w13_scale.view(torch.uint8), w.w2_scale.view(torch.uint8), w.scale_2.float()
    sh = shared if has_shared else w  # any valid pointers when there is no shared expert (never read)
    sw13, sw2 = as_words(sh.w13), as_words(sh.w2)
    ss13, ss2w, ss2 = sh.w13_scale.view(torch.uint8), sh.w2_scale.view(torch.uint8), sh.scale_2.float()
    if has_shared and (sw13.stride(1) != w13.stride(1) or ss13.stride(1) != s13.stride(1) or
                       sw2.stride(1) != w2.stride(1) or ss2w.stride(1) != s2w.stride(1)):
        raise ValueError("the shared expert's rows must have the slot pool's strides")
    has_host = host is not None
    if has_host:
        if topk_ids is None or tuple(topk_ids.shape) != (t, k):
            raise ValueError(f"a host store needs topk_ids [T, k] = [{t}, {k}]")
        if host.w13.shape[2:] != w.w13.shape[1:] or host.w2.shape[2:] != w.w2.shape[1:] or not host.is_nvfp4:
            raise ValueError("the host store's experts must have the slot pool's shapes (NVFP4)")
        hw13, hw2 = as_words(host.w13[layer]), as_words(host.w2[layer])
        hs13, hs2w, hs2 = host.w13_scale[layer].view(torch.uint8), host.w2_scale[layer].view(torch.uint8), \
            host.scale_2[layer].float()
        if hw13.stride(1) != w13.stride(1) or hs13.stride(1) != s13.stride(1) or hw2.stride(1) != w2.stride(1) \
                or hs2w.stride(1) != s2w.stride(1):
            raise ValueError("the host store's rows must have the slot pool's strides")
        ids = topk_ids if topk_ids.stride(-1) == 1 else topk_ids.contiguous()
    else:  # any valid pointers (never read: HAS_HOST is off)
        hw13, hw2, hs13, hs2w, hs2, ids = w13, w2, s13, s2w, s2, slots
    if has_dst:
        # the kernels write the pool in place: its tensors, not copies
        if w13.data_ptr() != w.w13.data_ptr() or w2.data_ptr() != w.w2.data_ptr() or s2.data_ptr() != \
                w.scale_2.data_ptr() or w.scale_2.dtype != torch.float32:
            raise ValueError("the landing store needs the pool's packed weights word-aligned and scale_2 float32")
        dst = topk_dst if topk_dst.stride(-1) == 1 else topk_dst.contiguous()
    else:  # any valid pointer (never read: HAS_DST is off)
        dst = slots
    has_live = live is not None
    if has_live and (tuple(live.shape) != (t,) or live.dtype not in (torch.int32, torch.int64) or live.stride(0) != 1):
        raise ValueError(f"live must be a contiguous int32/int64 [T] = [{t}], got {live.dtype} {tuple(live.shape)}")
    live_ptr = live if has_live else slots  # any valid pointer (never read: HAS_LIVE is off)
    ks = k + has_shared
    h = torch.empty((t * ks, i), dtype=torch.float32, device=x.device)
    opts = kernel_options().moe
    hid_pieces = whole_k_pieces(hid)  # a row of gate/up's K as one or two whole-K tiles, (0, 0) for neither
    one_token = opts.decode_tiles_one_token if t == 1 else None  # (None: the tables)
    two_tiles = opts.decode_gate_up_two_tiles if t > 1 and hid_pieces[1] else None
    block_i, bw13, warps13 = gate_up_config or (one_token[0] if one_token else two_tiles if two_tiles
                                                else DECODE_GATE_UP_CONFIG[min(t, 2)])
    per_pair = down_per_pair if down_per_pair is not None else t >= DECODE_DOWN_PAIRS_MIN_TOKENS
    block_h, bw2, warps2 = down_config or (
        (one_token[1] if one_token else down_pairs_config(i)) if per_pair else DECODE_DOWN_CONFIG[min(t, 2)])
    # a row's K in one or two whole-K tiles (`whole_k_pieces`), or the K loop (bw > 0, other K)
    whole13, whole13b = hid_pieces if bw13 == 0 else (0, 0)
    whole2, whole2b = whole_k_pieces(i) if bw2 == 0 else (0, 0)
    bw13 = max(2, min(bw13 or 64, triton.next_power_of_2(hid // 8)))
    bw2 = max(2, min(bw2 or 64, triton.next_power_of_2(i // 8)))
    # (checked before any launch: a landing store must not stop half way)
    if has_host and not (per_pair and whole2):
        raise ValueError("a host store needs the per-pair down pass over whole-K tiles (down_per_pair, I / 8 = 2^a "
                         "or 2^a + 2^b, 2^a <= 1024)")
    if has_dst and not whole13:
        raise ValueError("topk_dst needs the gate/up pass over whole-K tiles (BLOCK_W 0, H / 8 = 2^a or 2^a + 2^b, "
                         "2^a <= 1024)")
    asm = kernel_options().nvfp4.lanes_ptx and inline_ptx(x.device)  # the whole-K tiles' word decode in PTX
    # blocks summed in fp16 (whole-K tiles only) from two tokens: at one they lost (bench/RESULTS.md session 46)
    half = kernel_options().nvfp4.half_sums and t > 1 and half_sums_take(x)
    _moe_decode_gate_up_kernel[(t * ks, triton.cdiv(i, block_i))](
        x, slots, ids, dst, w13, s13, s2, sw13, ss13, ss2, hw13, hs13, hs2, h, live_ptr, i, hid,
        x.stride(0), slots.stride(0), ids.stride(0), dst.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), s2.stride(0), hw13.stride(0), hs13.stride(0), hs2.stride(0), h.stride(0), TOPK=k,
        HAS_SHARED=has_shared, BLOCK_I=block_i, BLOCK_W=bw13, WHOLE_K=whole13, HAS_HOST=has_host, HAS_DST=has_dst,
        ASM=asm and whole13 > 0, WHOLE_K2=whole13b, HAS_LIVE=has_live, HALF=half and whole13 > 0, num_warps=warps13,
        **pdl_args(x.device))
    fuse_norm = residual is not None and norm_weight is not None
    if per_pair and whole2:  # (a row's K in one tile; other shapes take the loop)
        y_pairs = torch.empty((t * ks, hid), dtype=torch.float32, device=x.device)
        blocks = triton.cdiv(hid, block_h)
        sums_here = (not fuse_norm and sum_counters is not None and opts.decode_sum_in_down
                     and sum_counters.dtype == torch.int32 and sum_counters.device == x.device
                     and sum_counters.numel() >= t * blocks and y.stride(-1) == 1)
        _moe_decode_down_pairs_kernel[(t * ks, blocks)](
            h, slots, ids, dst, wts, w2, s2w, s2, sw2, ss2w, ss2, hw2, hs2w, hs2, y_pairs, live_ptr, i, hid,
            h.stride(0), slots.stride(0), ids.stride(0), dst.stride(0), wts.stride(0), w2.stride(0), w2.stride(1),
            s2w.stride(0), s2w.stride(1), s2.stride(0), hw2.stride(0), hs2w.stride(0), hs2.stride(0), y_pairs.stride(0),
            sum_counters if sums_here else slots, y, y.stride(0),
            TOPK=k, HAS_SHARED=has_shared, BLOCK_H=block_h, WHOLE_K=whole2, HAS_HOST=has_host, HAS_DST=has_dst,
            ASM=asm, WHOLE_K2=whole2b, HAS_LIVE=has_live, SUM=sums_here, HALF=half, num_warps=warps2,
            **pdl_args(x.device))
        if sums_here:
            return y
        if fuse_norm and hid <= 8192 and residual.shape == x.shape and residual.dtype == x.dtype \
                and residual.stride(-1) == 1:
            h_out = torch.empty_like(x)
            block = triton.next_power_of_2(hid)
            _moe_sum_add_norm_kernel[(t,)](y_pairs, residual, norm_weight, y, h_out, hid, eps, y_pairs.stride(0),
                                           residual.stride(0), y.stride(0), h_out.stride(0), KS=ks, BLOCK_D=block,
                                           num_warps=norm_warps(block), **pdl_args(x.device))
            return y, h_out
        moe_sum_pairs_kernel[(t, triton.cdiv(hid, 1024))](y_pairs, y, hid, ks, y_pairs.stride(0), y.stride(0), BLOCK=1024,
                                                           **pdl_args(x.device))
        return add_rms_norm_triton(y, residual, norm_weight, eps) if fuse_norm else y
    _moe_decode_down_kernel[(t, triton.cdiv(hid, block_h))](
        h, slots, wts, w2, s2w, s2, sw2, ss2w, ss2, y, live_ptr, i, hid,
        h.stride(0), slots.stride(0), wts.stride(0), w2.stride(0), w2.stride(1), s2w.stride(0), s2w.stride(1),
        s2.stride(0), y.stride(0), TOPK=k, HAS_SHARED=has_shared, BLOCK_H=block_h, BLOCK_W=bw2, WHOLE_K=whole2,
        ASM=asm and whole2 > 0, WHOLE_K2=whole2b, HAS_LIVE=has_live, HALF=half and whole2 > 0, num_warps=warps2,
        **pdl_args(x.device))
    return add_rms_norm_triton(y, residual, norm_weight, eps) if fuse_norm else y
