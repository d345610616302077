"""QSA's decode kernels in Triton (`reference.py` is the contract of each).

`_block_scores_kernel`: program (b, tile of BLOCK_J blocks) reads each block's `RATIO` raw indexer
keys through the page table, takes their fp32 mean, RMS-normalizes it (1 + w), rotates its first ROT
features at the block's first position, and sums ReLU(q . key) over the indexer heads. A tile past
the sequence's complete blocks loads nothing and stores -inf at once, so the grid may be fixed by
(B, the context limit's blocks) (a CUDA graph holds it) while the work follows each sequence's length.

`_select_kernel`: program b picks sequence b's `W` best blocks (ties to the lower block) without a
sort: a binary search over the scores' bits (31 counting passes over its complete blocks; none while
every block fits the budget) finds the W-th best score T, then one pass writes, in block order, the
tokens of every block above T and of the lowest blocks at T, then -1, then the query's incomplete
block. Its loops run over the sequence's own blocks (read on the device), not the grid's width.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait


@triton.jit
def _block_scores_kernel(p_q, p_keys, p_pt, p_len, p_w, p_freq, p_out, MAXB, DENSE, DI, eps, rope_scale, inv_sqrt_d,
                         stride_qb, stride_qh, stride_kp, stride_ks, stride_ptb, stride_ob,
                         HI: tl.constexpr, RATIO: tl.constexpr, PAGE_SIZE: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_b, i_j = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_j = i_j * BLOCK_J + tl.arange(0, BLOCK_J)
    visible = tl.load(p_len + i_b).to(tl.int64) // RATIO
    if i_j * BLOCK_J >= visible:  # a tile past the complete blocks: nothing to read
        tl.store(p_out + i_b * stride_ob + o_j, tl.full((BLOCK_J,), float("-inf"), tl.float32), mask=o_j < MAXB)
        return
    if visible <= DENSE:  # inside the selection's budget every complete block is taken: score 0, no key read
        tl.store(p_out + i_b * stride_ob + o_j, tl.where(o_j < visible, 0.0, float("-inf")), mask=o_j < MAXB)
        return
    m_j = o_j < visible
    o_h = tl.arange(0, BLOCK_H)  # rotated pairs: columns o_h and HALF + o_h
    m_h = o_h < HALF
    o_r = tl.arange(0, BLOCK_R)  # the rest: columns 2 HALF + o_r
    m_r = 2 * HALF + o_r < DI
    x1 = tl.zeros((BLOCK_J, BLOCK_H), dtype=tl.float32)
    x2 = tl.zeros((BLOCK_J, BLOCK_H), dtype=tl.float32)
    x3 = tl.zeros((BLOCK_J, BLOCK_R), dtype=tl.float32)
    for r in tl.static_range(RATIO):
        pos = o_j * RATIO + r
        page = tl.load(p_pt + i_b * stride_ptb + pos // PAGE_SIZE, mask=m_j, other=0).to(tl.int64)
        row = p_keys + page * stride_kp + (pos % PAGE_SIZE) * stride_ks
        x1 += tl.load(row[:, None] + o_h[None, :], mask=m_j[:, None] & m_h[None, :], other=0.0).to(tl.float32)
        x2 += tl.load(row[:, None] + HALF + o_h[None, :], mask=m_j[:, None] & m_h[None, :], other=0.0).to(tl.float32)
        x3 += tl.load(row[:, None] + 2 * HALF + o_r[None, :], mask=m_j[:, None] & m_r[None, :], other=0.0).to(tl.float32)
    x1, x2, x3 = x1 / RATIO, x2 / RATIO, x3 / RATIO
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
    rstd = 1.0 / tl.sqrt(ss / DI + eps)
    w1 = 1.0 + tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)
    w2 = 1.0 + tl.load(p_w + HALF + o_h, mask=m_h, other=0.0).to(tl.float32)
    w3 = 1.0 + tl.load(p_w + 2 * HALF + o_r, mask=m_r, other=0.0).to(tl.float32)
    x1, x2, x3 = x1 * rstd[:, None] * w1[None, :], x2 * rstd[:, None] * w2[None, :], x3 * rstd[:, None] * w3[None, :]
    ang = (o_j * RATIO).to(tl.float32)[:, None] * tl.load(p_freq + o_h, mask=m_h, other=0.0)[None, :]
    cos, sin = tl.cos(ang) * rope_scale, tl.sin(ang) * rope_scale
    k1, k2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    total = tl.zeros((BLOCK_J,), dtype=tl.float32)
    for h in tl.static_range(HI):
        q = p_q + i_b * stride_qb + h * stride_qh
        q1 = tl.load(q + o_h, mask=m_h, other=0.0).to(tl.float32)
        q2 = tl.load(q + HALF + o_h, mask=m_h, other=0.0).to(tl.float32)
        q3 = tl.load(q + 2 * HALF + o_r, mask=m_r, other=0.0).to(tl.float32)
        s = tl.sum(k1 * q1[None, :], axis=1) + tl.sum(k2 * q2[None, :], axis=1) + tl.sum(x3 * q3[None, :], axis=1)
        total += tl.maximum(s, 0.0)
    out = tl.where(m_j, total * inv_sqrt_d, float("-inf"))
    tl.store(p_out + i_b * stride_ob + o_j, out, mask=o_j < MAXB)


def block_scores_triton(index_q: torch.Tensor, index_keys: torch.Tensor, page_table: torch.Tensor,
                        seq_lens: torch.Tensor, k_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                        rope_scale: float, ratio: int, max_blocks: int, dense_blocks: int = 0) -> torch.Tensor:
    """As `block_scores_ref`. Raises ValueError for a page size that is not a multiple of ratio or
    non-contiguous feature dims."""
    b, hi, di = index_q.shape
    page = index_keys.shape[1]
    if page % ratio:
        raise ValueError(f"qsa block scores: page size {page} is not a multiple of the block of {ratio}")
    if index_q.stride(-1) != 1 or index_keys.stride(-1) != 1:
        raise ValueError("qsa block scores: the feature dims of index_q and index_keys must be contiguous")
    half = inv_freq.shape[0]
    out = torch.empty(b, max_blocks, dtype=torch.float32, device=index_q.device)
    block_j = 32
    if b and max_blocks:
        _block_scores_kernel[(b, triton.cdiv(max_blocks, block_j))](
            index_q, index_keys, page_table, seq_lens, k_norm, inv_freq.float().contiguous(), out, max_blocks,
            dense_blocks, di,
            eps, rope_scale, 1.0 / math.sqrt(di), index_q.stride(0), index_q.stride(1), index_keys.stride(0),
            index_keys.stride(1), page_table.stride(0), out.stride(0), HI=hi, RATIO=ratio, PAGE_SIZE=page, HALF=half,
            BLOCK_H=max(2, triton.next_power_of_2(half)), BLOCK_R=max(2, triton.next_power_of_2(max(1, di - 2 * half))),
            BLOCK_J=block_j, num_warps=4, **pdl_args(index_q.device))
    return out


SELECT_BLOCK = 1024
"""Blocks a pass of `_select_kernel` reads at a time."""


@triton.jit
def _select_kernel(p_scores, p_len, p_out, W, stride_sb, stride_ob, RATIO: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program b: out[b] = `select_decode_tokens_ref`'s row b from scores[b] (>= 0 on its complete blocks,
    whose count is seq_lens[b] // RATIO; nothing past them is read)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    length = tl.load(p_len + i_b).to(tl.int64)
    n = length // RATIO
    p_scores += i_b * stride_sb
    p_out += i_b * stride_ob
    o = tl.arange(0, BLOCK)
    # T: the W-th largest score's bits (scores >= 0: their int32 bits rise with them); every block is
    # taken (T = -1) while n <= W. Invariant: at least W blocks >= lo, fewer than W >= hi.
    lo = tl.zeros((), dtype=tl.int32) - 1
    if n > W:
        lo = lo + 1
        hi = tl.zeros((), dtype=tl.int32) + 0x7F800001  # above +inf's bits
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            count = tl.zeros((), dtype=tl.int32)
            for start in range(0, n, BLOCK):
                m = start + o < n
                bits = (tl.load(p_scores + start + o, mask=m, other=0.0) + 0.0).to(tl.int32, bitcast=True)
                count += tl.sum((m & (bits >= mid)).to(tl.int32), axis=0)
            above = count >= W
            lo = tl.where(above, mid, lo)
            hi = tl.where(above, hi, mid)
    threshold = lo
    greater = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        m = start + o < n
        bits = (tl.load(p_scores + start + o, mask=m, other=0.0) + 0.0).to(tl.int32, bitcast=True)
        greater += tl.sum((m & (bits > threshold)).to(tl.int32), axis=0)
    ties_wanted = tl.minimum(n, W).to(tl.int32) - greater  # blocks at T to take, lowest first
    written = tl.zeros((), dtype=tl.int32)
    ties_seen = tl.zeros((), dtype=tl.int32)
    for start in range(0, n, BLOCK):
        m = start + o < n
        bits = (tl.load(p_scores + start + o, mask=m, other=0.0) + 0.0).to(tl.int32, bitcast=True)
        tie = (m & (bits == threshold)).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - 1
        take = (m & (bits > threshold)) | ((tie > 0) & (tie_rank < ties_wanted))
        slot = written + tl.cumsum(take.to(tl.int32), axis=0) - 1
        for r in tl.static_range(RATIO):
            tl.store(p_out + slot.to(tl.int64) * RATIO + r, (start + o) * RATIO + r, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie, axis=0)
    for start in range(written * RATIO, W * RATIO, BLOCK):  # the budget's unused entries
        tl.store(p_out + start + o, tl.full((BLOCK,), -1, tl.int64), mask=start + o < W * RATIO)
    o_t = tl.arange(0, BLOCK_T)
    tail = (length // RATIO) * RATIO + o_t  # the query's incomplete block: its tokens up to length - 1
    tl.store(p_out + W * RATIO + o_t, tl.where(tail < length, tail, -1), mask=o_t < RATIO - 1)


def select_decode_tokens_triton(scores: torch.Tensor, seq_lens: torch.Tensor, budget_blocks: int,
                                ratio: int) -> torch.Tensor:
    """As `select_decode_tokens_ref`. Raises ValueError for scores whose rows are not contiguous."""
    b = scores.shape[0]
    if scores.stride(-1) != 1:
        raise ValueError("qsa selection: the scores' rows must be contiguous")
    out = torch.empty(b, budget_blocks * ratio + ratio - 1, dtype=torch.int64, device=scores.device)
    if b:
        _select_kernel[(b,)](scores, seq_lens, out, budget_blocks, scores.stride(0), out.stride(0), RATIO=ratio,
                             BLOCK_T=max(2, triton.next_power_of_2(ratio)), BLOCK=SELECT_BLOCK, num_warps=8, **pdl_args(scores.device))
    return out
