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

__all__ = ["TILES_BLOCK", "group_pairs", "group_pairs_ref", "tile_bound"]

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


@triton.jit(do_not_specialize=["P", "G"])  # per-pass values: one compile serves every pass
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
