"""Tiles of (token, k) pairs that share a slot: the grouped MoE path's work list (details module of
`ft.kernels.moe`).

A prefill pass's P = T * k pairs are sorted by slot (`torch.sort`, stable), and every run of equal
slots is cut into tiles of at most BLOCK_M consecutive positions, the first tile of a run starting
at the run's first position. `group_pairs` builds the tile list on the device, without a host sync,
as one sort plus one single-program Triton kernel (`_pair_tiles_kernel`): a scan over the sorted
slots in blocks of `TILES_BLOCK` positions, carrying the current run's start and the tile count
from one block to the next. `group_pairs_ref` is the same list from torch scans (~20 launches,
and each costs host time that a 1,024-token prefill cannot hide: 48 layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["TILES_BLOCK", "decode_pair_tiles", "decode_tile_bound", "group_pairs", "group_pairs_ref", "tile_bound"]

TILES_BLOCK = 2048
"""Sorted positions the tile kernel scans per step (one program; a 4,096-token pass of top-10 is 20 steps)."""


def tile_bound(p: int, block_m: int, distinct: int) -> int:
    """G, the number of tiles `group_pairs` returns: ceil(p / block_m) + min(p, distinct), an upper
    bound on the live tiles (a run of r pairs takes ceil(r / block_m) <= r / block_m + 1 tiles, and
    there are at most min(p, distinct) runs). Unused tiles are empty (start = end = 0)."""
    return triton.cdiv(p, block_m) + min(p, distinct)


def group_pairs_ref(slots: torch.Tensor, block_m: int, distinct: int) -> tuple[torch.Tensor, ...]:
    """`group_pairs`' contract from torch scans (the reference; also no host sync)."""
    p = slots.numel()
    dev = slots.device
    sorted_slots, order = torch.sort(slots.to(torch.int32), stable=True)
    is_start = torch.ones(p, dtype=torch.bool, device=dev)
    is_start[1:] = sorted_slots[1:] != sorted_slots[:-1]
    run_id = torch.cumsum(is_start, 0) - 1  # [P], runs numbered 0..R-1
    pos = torch.arange(p, device=dev)
    run_start = torch.full((p,), p, dtype=torch.int64, device=dev).scatter_reduce_(0, run_id, pos, "amin")
    run_len = torch.zeros(p, dtype=torch.int64, device=dev).scatter_add_(0, run_id, torch.ones_like(pos))
    tiles_per_run = (run_len + block_m - 1) // block_m
    tile_end_cum = torch.cumsum(tiles_per_run, 0)
    tile = torch.arange(tile_bound(p, block_m, distinct), device=dev)
    run = torch.searchsorted(tile_end_cum, tile, right=True).clamp_(max=p - 1)
    first_tile = tile_end_cum[run] - tiles_per_run[run]
    start = run_start[run] + (tile - first_tile) * block_m
    end = torch.minimum(start + block_m, run_start[run] + run_len[run])
    live = tile < tile_end_cum[-1]
    start = torch.where(live, start, 0).to(torch.int32)
    end = torch.where(live, end, 0).to(torch.int32)
    return start, end, sorted_slots, order


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _pair_tiles_kernel(p_sorted, p_start, p_end, P, G, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """One program. Position i of the sorted slots opens a tile when (i - run_start(i)) % BLOCK_M
    == 0 and closes one when i + 1 opens one, starts another run, or is P; tile g's bounds go to
    start[g], end[g], and start = end = 0 for the tiles g in [live tiles, G)."""
    run_start = 0  # the start of the run holding the position before this block
    tiles = 0  # tiles opened before this block
    for b0 in range(0, P, BLOCK):
        o = b0 + tl.arange(0, BLOCK)
        m = o < P
        cur = tl.load(p_sorted + o, mask=m, other=0)
        prev = tl.load(p_sorted + o - 1, mask=m & (o > 0), other=0)
        nxt = tl.load(p_sorted + o + 1, mask=o + 1 < P, other=0)
        opens_run = m & ((o == 0) | (cur != prev))
        rs = tl.associative_scan(tl.where(opens_run, o, run_start), 0, _max_combine)
        opens = m & ((o - rs) % BLOCK_M == 0)
        closes = m & ((o + 1 == P) | (nxt != cur) | ((o + 1 - rs) % BLOCK_M == 0))
        g = tiles + tl.cumsum(opens.to(tl.int32), 0) - 1  # the tile of each position
        tl.store(p_start + g, o, mask=opens)
        tl.store(p_end + g, o + 1, mask=closes)
        run_start = tl.max(rs, 0)
        tiles += tl.sum(opens.to(tl.int32), 0)
    for g0 in range(0, G, BLOCK):
        o = g0 + tl.arange(0, BLOCK)
        m = (o >= tiles) & (o < G)
        tl.store(p_start + o, tl.zeros_like(o), mask=m)
        tl.store(p_end + o, tl.zeros_like(o), mask=m)


def group_pairs(slots: torch.Tensor, block_m: int, distinct: int) -> tuple[torch.Tensor, ...]:
    """Tiles of at most block_m (token, k) pairs that share a slot, computed on slots' device without a sync.

    Args: slots: int [P] (flattened topk_slots, -1 = skip); distinct: an upper bound on the
    distinct values in slots, -1 included (a layer's expert count + 1: each expert has at most
    one slot). A bound too small drops pairs; one too large launches empty programs.
    Returns: (tile_start int32 [G], tile_end int32 [G], sorted slots int32 [P], order int64 [P]):
    tile g covers positions [tile_start[g], tile_end[g]) of ``order`` (pair ids sorted by slot,
    stable), G = `tile_bound`; the live tiles come first, in slot order, the rest are empty.
    """
    p = slots.numel()
    sorted_slots, order = torch.sort(slots.to(torch.int32), stable=True)
    g = tile_bound(p, block_m, distinct)
    start = torch.empty(g, dtype=torch.int32, device=slots.device)
    end = torch.empty(g, dtype=torch.int32, device=slots.device)
    _pair_tiles_kernel[(1,)](sorted_slots, start, end, p, g, BLOCK_M=block_m, BLOCK=TILES_BLOCK, num_warps=8)
    return start, end, sorted_slots, order


@triton.jit
def _decode_pair_tiles_kernel(p_slots, p_keys, p_order, p_start, p_end, T, n_slots, G, stride_st,
                              TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK: tl.constexpr, BITS: tl.constexpr):
    """One program, P = T * KS <= BLOCK = 2^BITS pairs (KS = TOPK + HAS_SHARED): pair p = t * KS + j
    has key slots[t, j] + 1 for j < TOPK (0: skipped) and n_slots + 1 for the shared expert; the
    pairs sorted by (key, p) in registers (`tl.sort` of key << BITS | p), then cut into tiles as
    `_pair_tiles_kernel` does. p_keys: scratch [BLOCK] holding the sorted keys, so that each
    position reads its neighbours'."""
    KS: tl.constexpr = TOPK + HAS_SHARED
    P = T * KS
    o = tl.arange(0, BLOCK)
    m = o < P
    t = o // KS
    j = o % KS
    slot = tl.load(p_slots + t * stride_st + j, mask=m & (j < TOPK), other=0)
    key = tl.where(j < TOPK, tl.maximum(slot, -1) + 1, n_slots + 1)
    packed = tl.sort(tl.where(m, (key << BITS) | o, 0x7FFFFFFF))
    cur = packed >> BITS
    tl.store(p_order + o, packed & (BLOCK - 1), mask=m)
    tl.store(p_keys + o, cur)
    tl.debug_barrier()  # NOTE: every position's key stored before any neighbour reads it
    prev = tl.load(p_keys + o - 1, mask=m & (o > 0), other=-1)
    nxt = tl.load(p_keys + o + 1, mask=o + 1 < P, other=-1)
    opens_run = m & ((o == 0) | (cur != prev))
    rs = tl.associative_scan(tl.where(opens_run, o, 0), 0, _max_combine)
    opens = m & ((o - rs) % BLOCK_M == 0)
    closes = m & ((o + 1 == P) | (nxt != cur) | ((o + 1 - rs) % BLOCK_M == 0))
    g = tl.cumsum(opens.to(tl.int32), 0) - 1
    tl.store(p_start + g, o, mask=opens)
    tl.store(p_end + g, o + 1, mask=closes)
    tiles = tl.sum(opens.to(tl.int32), 0)
    for g0 in range(0, G, BLOCK):
        og = g0 + o
        mg = (og >= tiles) & (og < G)
        tl.store(p_start + og, tl.zeros_like(og), mask=mg)
        tl.store(p_end + og, tl.zeros_like(og), mask=mg)


def decode_tile_bound(p: int, block_m: int) -> int:
    """G of `decode_pair_tiles`: `tile_bound` with every pair its own run at worst."""
    return tile_bound(p, block_m, p)


def decode_pair_tiles(topk_slots: torch.Tensor, n_slots: int, has_shared: bool,
                      block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's (token, k) pairs in tiles of at most block_m pairs that read one expert, in one
    launch on topk_slots' device (no host sync; the decode MoE's grouped form, `decode_kernel`).

    Args: topk_slots: int32 or int64 [T, k] (-1 = skip, any row stride); n_slots: the pool's slot count;
    has_shared: pair j = k of every token is the shared expert (one more run).
    Returns: (tile_start, tile_end int32 [G], order int32 [P]), P = T * (k + has_shared), G =
    `decode_tile_bound(P, block_m)`: tile g covers positions [tile_start[g], tile_end[g]) of
    ``order``, the pair ids p = t * (k + has_shared) + j sorted by (skipped first, then slot, the
    shared expert last; p ascending within each); live tiles first, the rest empty (start = end = 0).
    Raises ValueError where the packed sort key does not fit 31 bits."""
    if topk_slots.stride(-1) != 1:
        topk_slots = topk_slots.contiguous()
    t, k = topk_slots.shape
    p = t * (k + int(has_shared))
    block = max(16, triton.next_power_of_2(p))
    bits = block.bit_length() - 1
    if (n_slots + 2) << bits >= 1 << 31:
        raise ValueError(f"decode_pair_tiles: {n_slots} slots x {p} pairs do not fit a 31-bit sort key")
    g = decode_tile_bound(p, block_m)
    dev = topk_slots.device
    keys = torch.empty(block, dtype=torch.int32, device=dev)
    order = torch.empty(p, dtype=torch.int32, device=dev)
    start = torch.empty(g, dtype=torch.int32, device=dev)
    end = torch.empty(g, dtype=torch.int32, device=dev)
    if p:
        _decode_pair_tiles_kernel[(1,)](topk_slots, keys, order, start, end, t, n_slots, g, topk_slots.stride(0),
                                        TOPK=k, HAS_SHARED=int(has_shared), BLOCK_M=block_m, BLOCK=block, BITS=bits,
                                        num_warps=4 if block <= 1024 else 8)
    return start, end, order
