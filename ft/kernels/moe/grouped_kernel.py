"""The grouped (prefill) path of the Triton MoE over NVFP4 slots (details module of `ft.kernels.moe`).

A prefill chunk's (token, k) pairs are grouped by slot (a stable sort and one scan kernel, on the
device, no host sync: `pair_tiles.group_pairs`) into tiles of at most BLOCK_M pairs of one slot.
Each tile is a GEMM against its slot's weights, dequantized tile by tile in registers:

1. `_grouped_gate_up_kernel`, grid (tiles, I / BLOCK_N): h[p] = silu(x[t] @ gate^T * s_g) *
   (x[t] @ up^T * s_u), h in x's dtype (the down GEMM's operand).
2. `_grouped_down_kernel`, grid (tiles, H / BLOCK_N): y_pairs[p] = w_p * s_d * (h[p] @ down^T) in
   fp32, stored in x's dtype; then `_sum_live_pairs_kernel`: one fp32 sum over k per token, in k
   order, of the pairs that have a slot (ordered: no atomics, so a token's result never depends on
   the timing of other tiles; skipped pairs are never written, so the workspace needs no zeroing).

An expert's weights are read and dequantized once per tile of its pairs, so the cost per token
falls with the pairs per expert: the caller passes whole prefill chunks (up to
`MoeOptions.grouped_max_tokens` tokens per pass, a bound on the workspace), not slices of them.

Dequantized tiles are exact in any dot dtype (an E2M1 value, 2 significant bits, times an E4M3
scale, 4 bits); the per-slot global scales are applied in the epilogues. Measured and dropped
(H200, bench/RESULTS.md): two dots per K step over the even and the odd elements, which avoids
interleaving the low and high nibbles in registers, ran 1.5-2x slower than one interleaved tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.moe.pair_tiles import group_pairs
from ft.kernels.moe.slots import GROUPED_SHORT_TOKENS
from ft.kernels.options import kernel_options
from ft.kernels.nvfp4.decode import dequant_tile, words_tile_f16

__all__ = ["GROUPED_CONFIG", "GROUPED_CONFIG_SHORT", "GROUPED_SHORT_TOKENS", "grouped_config_for",
           "grouped_moe", "grouped_pairs", "sum_live_pairs"]

# the word-wise weight decode is an option: `ft.kernels.options.MoeOptions.grouped_words`

GROUPED_CONFIG = ((128, 64, 64, 4, 4, True), (128, 64, 64, 4, 3, True))
"""(gate_up's tile, down's tile), each (BLOCK_M pairs, BLOCK_N rows, BLOCK_K, num_warps, num_stages,
SWAP_AB), of the grouped passes over more than GROUPED_SHORT_TOKENS tokens. gate_up: the H200 sweep's
best at 4,096 tokens (one layer, 512 experts, top-10: 2.094 ms for both passes against 2.439 for the
former (64, 64, 64, 4, 4); bench/moe_prefill.py --sweep, bench/RESULTS.md, 2026-12-01): ~80 pairs per
expert fill one 128-pair tile, so each expert's weights are decoded once, and the decoded tile feeds
the MMA from registers. down (K = 512): BLOCK_K 64 in 3 stages since session 64 (H100, today's kernel, one
layer of the 80B's experts, ms for both passes, two rounds each: 4,096 tokens 1.612 / 1.631 against 1.701 /
1.704 for BLOCK_K 128 in 3 stages, 8,192 3.024 / 3.029 against 3.160 / 3.161, 12,288 3.416 / 3.417 against
3.557 / 3.559, 16,384 4.574 / 4.577 against 4.877 / 4.776: 4-5% at every length; 4 stages in between). Session
12 had found BLOCK_K 128 better on the H200 with the byte-wise decode and tiles-first order (2.003 -> 1.963 ms
at 4,096); variant "moe-grouped-down-k128" restores it for an A/B: in whole prefills (session 65, H100, 12 layers
of either model, alternating) the two tie within 1-2%; not yet timed on an H200 with today's decode, the variant stays
for that A/B. 256-pair tiles (session 64, a 16K pass gives
an expert ~320 pairs) lost at 16,384 tokens, 5.90-22.86 ms against 4.76-4.81, and tied or lost at 8,192."""
GROUPED_CONFIG_SHORT = (32, 64, 128, 4, 3, True)
"""The tile of shorter passes: at 1,024 tokens (~20 pairs per expert) 1.187 ms against 1.325 for
(64, 64, 64, 4, 4) and 1.833 for GROUPED_CONFIG (a 128-pair tile mostly empty)."""


def grouped_config_for(tokens: int) -> tuple:
    """The grouped tile of a pass over `tokens` tokens: `MoeOptions.grouped_tile` when one is set,
    else GROUPED_CONFIG or, up to GROUPED_SHORT_TOKENS tokens, GROUPED_CONFIG_SHORT."""
    return kernel_options().moe.grouped_tile or (GROUPED_CONFIG_SHORT if tokens <= GROUPED_SHORT_TOKENS
                                                 else GROUPED_CONFIG)


@triton.jit
def _tile_and_column(COLUMNS_FIRST: tl.constexpr):
    """(tile, column block) of this program: grid (tiles, column blocks), or with COLUMNS_FIRST
    (column blocks, tiles), so that the programs running at once are a few tiles' column blocks, which
    share their tiles' activation rows in L2, rather than one column block of hundreds of tiles."""
    if COLUMNS_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _tile_pairs(i_tile, p_tile_start, p_tile_end, p_sorted, p_order, TOPK, BLOCK_M: tl.constexpr):
    """The pairs of tile i_tile: (slot, pair ids [BLOCK_M], mask [BLOCK_M], tokens [BLOCK_M],
    sorted positions [BLOCK_M]: the pairs' rows in the slot-sorted order, contiguous within a tile)."""
    start = tl.load(p_tile_start + i_tile)
    end = tl.load(p_tile_end + i_tile)
    o_pos = start + tl.arange(0, BLOCK_M)
    m_pos = o_pos < end
    pairs = tl.load(p_order + o_pos, mask=m_pos, other=0)
    slot = tl.load(p_sorted + tl.minimum(start, end - 1), mask=end > start, other=-1)
    return slot, pairs, m_pos, pairs // TOPK, o_pos


@triton.jit
def _tile_dot(acc, p_a, o_a, m_a, k, K, p_w, p_s, o_r, m_r, stride_wr, stride_sr, dtype: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr = False,
              SWAP_AB: tl.constexpr = False, WORDS: tl.constexpr = False):
    """acc [M, BLOCK_R] += A[:, k:k+BLOCK_K] @ W[o_r, k:k+BLOCK_K]^T; A's rows at p_a + o_a (element
    offsets of each row, contiguous along K), W NVFP4 (uint8 at p_w, E4M3 block scales at p_s).
    EVEN_K: K % BLOCK_K == 0: no mask along K, so that the loads vectorize (`dequant_tile`'s EVEN).
    SWAP_AB: acc is [BLOCK_R, M] += W A^T instead: the dequantized weight tile is the MMA's left
    operand (from registers on Hopper, no shared-memory round trip) and the pairs its narrow side.
    WORDS (with EVEN_K; row strides and k multiples of 4 bytes): the weight tile decoded a 32-bit word
    of codes at a time, in fp16, then cast to dtype (`words_tile_f16`; exact either way)."""
    o_k = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        m_ak = m_a[:, None]
    else:
        m_ak = m_a[:, None] & (o_k < K)[None, :]
    b_a = tl.load(p_a + o_a[:, None] + o_k[None, :], mask=m_ak, other=0.0)
    if WORDS and EVEN_K:
        b_w = words_tile_f16(p_w, p_s, o_r * stride_wr, o_r * stride_sr, m_r, k // 2, BLOCK_R, BLOCK_K).to(dtype)
    else:
        b_w = dequant_tile(p_w, p_s, o_r, m_r, stride_wr, stride_sr, k // 2, K // 2, dtype, BLOCK_R, BLOCK_K, EVEN_K)
    if SWAP_AB:
        acc = tl.dot(b_w, tl.trans(b_a), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(b_a, tl.trans(b_w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grouped_gate_up_kernel(
    p_x, p_tile_start, p_tile_end, p_sorted, p_order, p_w13, p_s13, p_s2, p_h,
    I, H, TOPK,
    stride_xt, stride_w13e, stride_w13r, stride_s13e, stride_s13r, stride_s2e, stride_hp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr = False, SWAP_AB: tl.constexpr = False, WORDS: tl.constexpr = False,
    H_SORTED: tl.constexpr = False, COLUMNS_FIRST: tl.constexpr = False,
):
    i_tile, i_col = _tile_and_column(COLUMNS_FIRST)
    slot, pairs, m_p, toks, o_pos = _tile_pairs(i_tile, p_tile_start, p_tile_end, p_sorted, p_order, TOPK, BLOCK_M)
    if slot >= 0:
        e = slot.to(tl.int64)
        o_n = i_col * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < I
        p_w = p_w13 + e * stride_w13e
        p_s = p_s13 + e * stride_s13e
        o_x = toks.to(tl.int64) * stride_xt
        acc_g = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, H, BLOCK_K):
            acc_g = _tile_dot(acc_g, p_x, o_x, m_p, k, H, p_w, p_s, o_n, m_n, stride_w13r, stride_s13r,
                              p_x.dtype.element_ty, BLOCK_N, BLOCK_K, PRECISION, EVEN_K, SWAP_AB, WORDS)
            acc_u = _tile_dot(acc_u, p_x, o_x, m_p, k, H, p_w, p_s, o_n + I, m_n, stride_w13r, stride_s13r,
                              p_x.dtype.element_ty, BLOCK_N, BLOCK_K, PRECISION, EVEN_K, SWAP_AB, WORDS)
        if SWAP_AB:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        b_g = acc_g * tl.load(p_s2 + e * stride_s2e)
        b_u = acc_u * tl.load(p_s2 + e * stride_s2e + 1)
        b_h = b_g / (1.0 + tl.exp(-b_g)) * b_u
        r_h = o_pos if H_SORTED else pairs
        tl.store(p_h + r_h.to(tl.int64)[:, None] * stride_hp + o_n[None, :], b_h.to(p_h.dtype.element_ty),
                 mask=m_p[:, None] & m_n[None, :])


@triton.jit
def _grouped_down_kernel(
    p_h, p_tile_start, p_tile_end, p_sorted, p_order, p_wts, p_w2, p_s2w, p_s2, p_y,
    I, H, TOPK,
    stride_hp, stride_w2e, stride_w2r, stride_s2we, stride_s2wr, stride_s2e, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr = False, SWAP_AB: tl.constexpr = False, WORDS: tl.constexpr = False,
    H_SORTED: tl.constexpr = False, COLUMNS_FIRST: tl.constexpr = False,
):
    i_tile, i_col = _tile_and_column(COLUMNS_FIRST)
    slot, pairs, m_p, toks, o_pos = _tile_pairs(i_tile, p_tile_start, p_tile_end, p_sorted, p_order, TOPK, BLOCK_M)
    if slot >= 0:
        e = slot.to(tl.int64)
        o_n = i_col * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < H
        acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
        o_a = (o_pos if H_SORTED else pairs).to(tl.int64) * stride_hp
        for k in range(0, I, BLOCK_K):
            acc = _tile_dot(acc, p_h, o_a, m_p, k, I, p_w2 + e * stride_w2e, p_s2w + e * stride_s2we, o_n, m_n,
                            stride_w2r, stride_s2wr, p_h.dtype.element_ty, BLOCK_N, BLOCK_K, PRECISION, EVEN_K,
                            SWAP_AB, WORDS)
        if SWAP_AB:
            acc = tl.trans(acc)
        b_wt = tl.load(p_wts + pairs, mask=m_p, other=0.0).to(tl.float32) * tl.load(p_s2 + e * stride_s2e + 2)
        tl.store(p_y + pairs[:, None] * stride_yp + o_n[None, :], (acc * b_wt[:, None]).to(p_y.dtype.element_ty),
                 mask=m_p[:, None] & m_n[None, :])


@triton.jit
def _sum_live_pairs_kernel(p_yp, p_slots, p_out, H, TOPK, stride_yp, stride_ot, BLOCK: tl.constexpr):
    """Grid (T, H / BLOCK): out[t] = sum over j in order of yp[t * TOPK + j] where slots[t * TOPK + j]
    >= 0 (the rows of skipped pairs are never read), in fp32, cast to out's dtype."""
    i_t = tl.program_id(0)
    o_h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_h = o_h < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOPK):
        pair = i_t * TOPK + j
        if tl.load(p_slots + pair) >= 0:
            acc += tl.load(p_yp + pair.to(tl.int64) * stride_yp + o_h, mask=m_h, other=0.0).to(tl.float32)
    tl.store(p_out + i_t * stride_ot + o_h, acc.to(p_out.dtype.element_ty), mask=m_h)


def grouped_moe(x, slots, wts, k, w13, s13, w2, s2w, s2, y, i, cfg, distinct: int | None = None) -> torch.Tensor:
    """One grouped pass: y [T, H] = sum over k of the pairs' weighted expert outputs.

    x [T, H]; slots [T * k] int32 (-1: skip), wts [T * k]; w13, w2 the uint8 slot pools, s13, s2w their
    E4M3 block scales as uint8, s2 float32 [S, 3]; i the intermediate size; cfg a `GROUPED_CONFIG`
    tuple (a sixth element, true: SWAP_AB), or a pair of them (gate_up's, down's) with one BLOCK_M; distinct: `group_pairs`'s bound (default: the pool's
    slot count + 1, always safe; a layer's expert count + 1 launches far fewer empty tiles). Allocates h [T * k, I] and y_pairs [T * k, H] in x's dtype (`moe_workspace_bytes`).
    """
    t, hid = x.shape
    y_pairs = torch.empty((t * k, hid), dtype=x.dtype, device=x.device)  # skipped pairs' rows: never read
    grouped_pairs(x, slots, wts, k, w13, s13, w2, s2w, s2, y_pairs, i, cfg, distinct)
    return sum_live_pairs(y_pairs, slots, y, k)


def grouped_pairs(x, slots, wts, k, w13, s13, w2, s2w, s2, y_pairs, i, cfg, distinct: int | None = None) -> None:
    """The grouped GEMMs of one pass without the sum: y_pairs[p] = w_p * down(silu(gate) * up)(x[p // k])
    for every pair p with slots[p] >= 0, in y_pairs' dtype; the rows of skipped pairs are left as they
    are (so passes over different pools can fill one y_pairs). Arguments as `grouped_moe`'s;
    y_pairs [T * k, H]. Allocates h [T * k, I] in x's dtype. A pair's row depends only on its
    token, its weight and its expert's weights (not on which pool or tile held it)."""
    t, hid = x.shape
    cfg13, cfg2 = cfg if isinstance(cfg[0], tuple) else (cfg, cfg)
    if cfg13[0] != cfg2[0]:
        raise ValueError(f"the gate_up and down tiles share BLOCK_M (one tile list): {cfg13}, {cfg2}")
    block_m = cfg13[0]
    start, end, sorted_slots, order = group_pairs(slots, block_m, distinct or w13.shape[0] + 1)
    h = torch.empty((t * k, i), dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    g = start.numel()
    # word loads need 4-byte aligned rows and k steps (BLOCK_K / 2 bytes)
    words = kernel_options().moe.grouped_words and all(t.stride(1) % 4 == 0 for t in (w13, w2)) and w13.data_ptr() % 16 == 0 \
        and w2.data_ptr() % 16 == 0
    h_sorted = kernel_options().moe.grouped_h_sorted
    columns_first = kernel_options().moe.grouped_columns_first and g <= MAX_GRID_Y
    _, bn13, bk13, warps13, stages13, *rest13 = cfg13
    bn13, bk13 = min(bn13, triton.next_power_of_2(i)), min(bk13, triton.next_power_of_2(hid))
    _grouped_gate_up_kernel[_grid(g, triton.cdiv(i, bn13), columns_first)](
        x, start, end, sorted_slots, order, w13, s13, s2, h, i, hid, k,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s2.stride(0), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn13, BLOCK_K=bk13, PRECISION=precision,
        EVEN_K=hid % bk13 == 0, SWAP_AB=bool(rest13 and rest13[0]), WORDS=words and bk13 % 16 == 0,
        H_SORTED=h_sorted, COLUMNS_FIRST=columns_first, num_warps=warps13, num_stages=stages13,
    )
    _, bn2, bk2, warps2, stages2, *rest2 = cfg2
    bk2 = min(bk2, triton.next_power_of_2(i))
    _grouped_down_kernel[_grid(g, triton.cdiv(hid, bn2), columns_first)](
        h, start, end, sorted_slots, order, wts, w2, s2w, s2, y_pairs, i, hid, k,
        h.stride(0), w2.stride(0), w2.stride(1), s2w.stride(0), s2w.stride(1), s2.stride(0), y_pairs.stride(0),
        BLOCK_M=block_m, BLOCK_N=bn2, BLOCK_K=bk2, PRECISION=precision, EVEN_K=i % bk2 == 0,
        SWAP_AB=bool(rest2 and rest2[0]), WORDS=words and bk2 % 16 == 0, H_SORTED=h_sorted,
        COLUMNS_FIRST=columns_first, num_warps=warps2, num_stages=stages2,
    )


MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension (the tiles' axis when the column blocks come first)."""


def _grid(tiles: int, columns: int, columns_first: bool) -> tuple[int, int]:
    return (columns, tiles) if columns_first else (tiles, columns)


def sum_live_pairs(y_pairs: torch.Tensor, live: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """y [T, H] = per token, the fp32 sum in routing order of y_pairs' rows [T * k, H] whose pair is
    live (live [T * k] int32 >= 0), cast to y's dtype; returns y."""
    t, hid = y.shape
    _sum_live_pairs_kernel[(t, triton.cdiv(hid, 1024))](y_pairs, live, y, hid, k, y_pairs.stride(0), y.stride(0),
                                                         BLOCK=1024)
    return y
