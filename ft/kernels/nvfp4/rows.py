"""Row dot products of NVFP4 weights against one or a few rows of x, fp32 (details module of
`ft.kernels.nvfp4`): the building blocks of the GEMV (`kernel.py`'s GEMV kernel) and of the
decode MoE kernels (`ft.kernels.moe`). Weight layout as `kernel.py` describes: int32 words of 8
E2M1 codes, E4M3 block scales per 16 elements (two words), the global scale left to the caller.

`nvfp4_rows_dot` walks K in steps of BLOCK_W words; `rows_dot_whole_k` takes a row's whole K in
one tile (K / 8 a power of two <= 1024), in parts (`load_whole_k`, `decode_whole_k`, `x_lanes`,
`dot_lanes`, `store_whole_k`) for kernels that place other work in between (the MoE's landing
store, a PDL wait) or take K in two such tiles (`limits.whole_k_pieces`: the decode MoE at 2,560 and
640). `dot_whole_k` is the tile's dot at one x row in either form: the fp32 sums (`decode_whole_k`,
`dot_lanes`) or each block's sums in fp16 (`dot_words_half`, `Nvfp4Options.half_sums`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.kernels.nvfp4.decode import (HALF_SUM_LIMIT_EXPONENT, f16_pair, byte_f32, e4m3_f32, hi_e4m3_word, lo_e4m3_word,
                                     pair_half_sum, split8, e2m1_word_lanes_f32)

__all__ = ["dot_whole_k", "dot_words_half", "nvfp4_rows_dot", "rows_dot_whole_k"]


@triton.jit
def _word_products(b_w, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum over a word's 8 elements of dec(W) * x: b_w uint32 [R, W] (R rows, W words) and x lanes
    [M, W] (lane j = element 8w + j) -> fp32 [M, R, W] (times 2**-6, before the block scale)."""
    lo = lo_e4m3_word(b_w)
    hi = hi_e4m3_word(b_w)
    acc = byte_f32(lo, 0)[None, :, :] * x0[:, None, :]
    acc += byte_f32(hi, 0)[None, :, :] * x1[:, None, :]
    acc += byte_f32(lo, 1)[None, :, :] * x2[:, None, :]
    acc += byte_f32(hi, 1)[None, :, :] * x3[:, None, :]
    acc += byte_f32(lo, 2)[None, :, :] * x4[:, None, :]
    acc += byte_f32(hi, 2)[None, :, :] * x5[:, None, :]
    acc += byte_f32(lo, 3)[None, :, :] * x6[:, None, :]
    acc += byte_f32(hi, 3)[None, :, :] * x7[:, None, :]
    return acc


@triton.jit
def nvfp4_rows_dot(
    p_w, p_s, o_r, m_r, stride_wr, stride_sr,
    p_x, o_xm, m_xm, stride_xm, w_lo, w_hi,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """sum_k x[m, k] * dequant(W)[r, k] / scale_2 over the words [w_lo, w_hi) of rows o_r -> fp32 [BLOCK_M, BLOCK_R].

    p_w: int32 words of the packed rows (row r at p_w + r * stride_wr); p_s: uint8 E4M3 block
    scales (row r at p_s + r * stride_sr, scale g covers words 2g, 2g + 1); x rows at
    p_x + o_xm * stride_xm (element k at + k), any float dtype; masked rows (m_r, m_xm) give 0.
    w_lo must be even (a block-scale boundary). The caller multiplies by the global scale.
    """
    if BLOCK_M == 1:
        w_end = tl.where(tl.sum(m_xm.to(tl.int32), axis=0) > 0, w_hi, w_lo)  # a masked x row reads nothing
        return _rows_dot_1(p_w, p_s, o_r, m_r, stride_wr, stride_sr, p_x + tl.sum(o_xm, axis=0) * stride_xm,
                           w_lo, w_end, BLOCK_R, BLOCK_W)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_R, BLOCK_W), dtype=tl.float32)
    o_8 = tl.arange(0, 8)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        m_w = o_w < w_hi
        m_rw = m_r[:, None] & m_w[None, :]
        b_w = tl.load(p_w + o_r[:, None] * stride_wr + o_w[None, :], mask=m_rw, other=0).to(tl.uint32, bitcast=True)
        b_s = e4m3_f32(tl.load(p_s + o_r[:, None] * stride_sr + (o_w // 2)[None, :], mask=m_rw, other=0))
        p_xt = p_x + o_xm[:, None, None] * stride_xm + (8 * o_w)[None, :, None] + o_8[None, None, :]
        b_x = tl.load(p_xt, mask=m_xm[:, None, None] & m_w[None, :, None], other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = split8(b_x, BLOCK_M, BLOCK_W)
        acc += _word_products(b_w, x0, x1, x2, x3, x4, x5, x6, x7) * b_s[None, :, :]
    return tl.sum(acc, axis=2) * 64.0


@triton.jit
def _rows_dot_1(p_w, p_s, o_r, m_r, stride_wr, stride_sr, p_xr, w_lo, w_hi,
                BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """`nvfp4_rows_dot` for one x row at p_xr -> fp32 [BLOCK_R].

    2-D accumulator (no [M, R, W] broadcast): fewer layout conversions in the loop (bench/RESULTS.md);
    partial sums per word pair, then one multiply by the pair's block scale."""
    BG: tl.constexpr = BLOCK_W // 2
    acc = tl.zeros((BLOCK_R, BG), dtype=tl.float32)
    o_8 = tl.arange(0, 8)
    for w0 in range(w_lo, w_hi, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        o_g = w0 // 2 + tl.arange(0, BG)
        m_w = o_w < w_hi
        b_w = tl.load(p_w + o_r[:, None] * stride_wr + o_w[None, :], mask=m_r[:, None] & m_w[None, :], other=0)
        b_w = b_w.to(tl.uint32, bitcast=True)
        m_s = m_r[:, None] & (o_g * 2 < w_hi)[None, :]
        b_s = e4m3_f32(tl.load(p_s + o_r[:, None] * stride_sr + o_g[None, :], mask=m_s, other=0))
        b_x = tl.load(p_xr + (8 * o_w)[:, None] + o_8[None, :], mask=m_w[:, None], other=0.0).to(tl.float32)
        x0, x1, x2, x3, x4, x5, x6, x7 = split8(tl.reshape(b_x, (1, BLOCK_W, 8)), 1, BLOCK_W)
        lo = lo_e4m3_word(b_w)
        hi = hi_e4m3_word(b_w)
        part = byte_f32(lo, 0) * tl.reshape(x0, (1, BLOCK_W))
        part += byte_f32(hi, 0) * tl.reshape(x1, (1, BLOCK_W))
        part += byte_f32(lo, 1) * tl.reshape(x2, (1, BLOCK_W))
        part += byte_f32(hi, 1) * tl.reshape(x3, (1, BLOCK_W))
        part += byte_f32(lo, 2) * tl.reshape(x4, (1, BLOCK_W))
        part += byte_f32(hi, 2) * tl.reshape(x5, (1, BLOCK_W))
        part += byte_f32(lo, 3) * tl.reshape(x6, (1, BLOCK_W))
        part += byte_f32(hi, 3) * tl.reshape(x7, (1, BLOCK_W))
        acc += tl.sum(tl.reshape(part, (BLOCK_R, BG, 2)), axis=2) * b_s
    return tl.sum(acc, axis=1) * 64.0


@triton.jit
def load_whole_k(p_w, p_s, o_r, m_r, stride_wr, stride_sr, KW: tl.constexpr):
    """Rows o_r's whole K (KW words), as stored: the packed words (uint32 [R, KW]) and the E4M3
    block scale bytes (uint8 [R, KW / 2]); masked rows give 0. Apart from `decode_whole_k` so
    that a caller can also store the raw bytes (the MoE's read-through landing store)."""
    o_w = tl.arange(0, KW)
    o_g = tl.arange(0, KW // 2)
    b_w = tl.load(p_w + o_r[:, None] * stride_wr + o_w[None, :], mask=m_r[:, None], other=0).to(tl.uint32, bitcast=True)
    b_s = tl.load(p_s + o_r[:, None] * stride_sr + o_g[None, :], mask=m_r[:, None], other=0)
    return b_w, b_s


@triton.jit
def store_whole_k(p_w, p_s, o_r, m_r, stride_wr, stride_sr, b_w, b_s, KW: tl.constexpr):
    """`load_whole_k`'s words and scale bytes stored as loaded into rows o_r at p_w (int32 words) and
    p_s (bytes), rows where m_r is off skipped: the MoE's read-through landing store."""
    o_w = tl.arange(0, KW)
    o_g = tl.arange(0, KW // 2)
    tl.store(p_w + o_r[:, None] * stride_wr + o_w[None, :], b_w.to(tl.int32, bitcast=True), mask=m_r[:, None])
    tl.store(p_s + o_r[:, None] * stride_sr + o_g[None, :], b_s, mask=m_r[:, None])


@triton.jit
def decode_whole_k(b_w, b_s, ASM: tl.constexpr = False):
    """`load_whole_k`'s words and scale bytes -> the 8 decoded element lanes (fp32 [R, KW], times
    2**-6) and the block scale of each word pair (fp32 [R, KW / 2]). ASM: the lanes by
    `e2m1_word_lanes_f32`'s PTX (the same values)."""
    d0, d1, d2, d3, d4, d5, d6, d7 = e2m1_word_lanes_f32(b_w, ASM)
    return d0, d1, d2, d3, d4, d5, d6, d7, e4m3_f32(b_s)


@triton.jit
def whole_k_tile(p_w, p_s, o_r, m_r, stride_wr, stride_sr, KW: tl.constexpr, ASM: tl.constexpr = False):
    """Rows o_r's whole K (KW words): the 8 decoded element lanes (fp32 [R, KW], times 2**-6) and
    the block scale of each word pair (fp32 [R, KW / 2]); masked rows give 0.
    `load_whole_k` then `decode_whole_k`."""
    b_w, b_s = load_whole_k(p_w, p_s, o_r, m_r, stride_wr, stride_sr, KW)
    return decode_whole_k(b_w, b_s, ASM)


@triton.jit
def x_lanes(p_xr, KW: tl.constexpr):
    """One x row at p_xr (K = 8 * KW, any float dtype) -> its 8 word lanes, fp32 [1, KW] each (lane j: elements 8w + j)."""
    o_w = tl.arange(0, KW)
    b_x = tl.load(p_xr + (8 * o_w)[:, None] + tl.arange(0, 8)[None, :]).to(tl.float32)
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(tl.reshape(b_x, (1, KW, 8)), 1, KW)
    return (tl.reshape(x0, (1, KW)), tl.reshape(x1, (1, KW)), tl.reshape(x2, (1, KW)), tl.reshape(x3, (1, KW)),
            tl.reshape(x4, (1, KW)), tl.reshape(x5, (1, KW)), tl.reshape(x6, (1, KW)), tl.reshape(x7, (1, KW)))


@triton.jit
def dot_lanes(d0, d1, d2, d3, d4, d5, d6, d7, b_s, x0, x1, x2, x3, x4, x5, x6, x7,
               KW: tl.constexpr, BLOCK_R: tl.constexpr):
    """Decoded lanes [R, KW] (`whole_k_tile`) and x lanes [1, KW] (`x_lanes`) -> sum_k x[k] * W[r, k] / scale_2, fp32 [R]."""
    part = d0 * x0
    part += d1 * x1
    part += d2 * x2
    part += d3 * x3
    part += d4 * x4
    part += d5 * x5
    part += d6 * x6
    part += d7 * x7
    return tl.sum(tl.sum(tl.reshape(part, (BLOCK_R, KW // 2, 2)), axis=2) * b_s, axis=1) * 64.0


@triton.jit
def _pairs_of(p, KW: tl.constexpr):
    """uint32 [1, KW] (a value per word) -> its even words' and its odd words' values, [1, KW / 2] each."""
    return tl.split(tl.reshape(p, (1, KW // 2, 2)))


@triton.jit
def dot_words_half(b_w, b_sb, x0, x1, x2, x3, x4, x5, x6, x7, KW: tl.constexpr, BLOCK_R: tl.constexpr,
                   ASM: tl.constexpr = False):
    """`decode_whole_k` then `dot_lanes` with each block's 16 products summed in fp16 (`pair_half_sum`):
    `load_whole_k`'s words and scale bytes and x's lanes (`x_lanes`) -> sum_k x[k] * W[r, k] / scale_2,
    fp32 [R]. x is rounded to fp16 (an fp32 x loses bits; bf16 fits, and its products are exact), a block's
    two running sums of 8 round in fp16 (relative error ~2**-11 of the block's sum, under bf16's
    rounding of the result), the blocks add in fp32. An x row with an element of magnitude
    `HALF_SUM_LIMIT` (2**15) or more is scaled by the power of two that brings its largest under it, and
    the result back (exact but for elements that fall below fp16's normal range: a negligible share of
    the sum), so the fp16 sums cannot overflow; below it the scale is 1. One reduction a program."""
    big = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                     tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    # the power of two, from the largest |x|'s fp32 exponent: 2**e <= |x| < 2**(e + 1); e >= L (the limit's
    # exponent) -> 2**(e - L + 1), which brings it under 2**L
    e = ((tl.max(tl.max(big, axis=1), axis=0).to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    shift = tl.maximum(e - (HALF_SUM_LIMIT_EXPONENT - 1), 0)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)  # 2**-shift, exact (shift <= 114: normal)
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    h0, h1, h2, h3 = (x0 * down).to(tl.float16), (x1 * down).to(tl.float16), (x2 * down).to(tl.float16), \
        (x3 * down).to(tl.float16)
    h4, h5, h6, h7 = (x4 * down).to(tl.float16), (x5 * down).to(tl.float16), (x6 * down).to(tl.float16), \
        (x7 * down).to(tl.float16)
    e02, o02 = _pairs_of(f16_pair(h0, h2), KW)
    e13, o13 = _pairs_of(f16_pair(h1, h3), KW)
    e46, o46 = _pairs_of(f16_pair(h4, h6), KW)
    e57, o57 = _pairs_of(f16_pair(h5, h7), KW)
    w_e, w_o = tl.split(tl.reshape(b_w, (BLOCK_R, KW // 2, 2)))
    part = pair_half_sum(w_e, w_o, e02, e13, e46, e57, o02, o13, o46, o57, ASM)  # [R, KW / 2]
    return tl.sum(part * e4m3_f32(b_sb), axis=1) * (64.0 * up)


@triton.jit
def dot_whole_k(b_w, b_sb, x0, x1, x2, x3, x4, x5, x6, x7, KW: tl.constexpr, BLOCK_R: tl.constexpr,
                ASM: tl.constexpr = False, HALF: tl.constexpr = False):
    """`load_whole_k`'s words and scale bytes dotted with x's lanes (`x_lanes`) -> fp32 [R], / scale_2:
    `decode_whole_k` then `dot_lanes`, or with HALF `dot_words_half`."""
    if HALF:
        y = dot_words_half(b_w, b_sb, x0, x1, x2, x3, x4, x5, x6, x7, KW, BLOCK_R, ASM)
    else:
        d0, d1, d2, d3, d4, d5, d6, d7, b_s = decode_whole_k(b_w, b_sb, ASM)
        y = dot_lanes(d0, d1, d2, d3, d4, d5, d6, d7, b_s, x0, x1, x2, x3, x4, x5, x6, x7, KW, BLOCK_R)
    return y


@triton.jit
def whole_k_row(d0, d1, d2, d3, d4, d5, d6, d7, b_s, p_xr, KW: tl.constexpr, BLOCK_R: tl.constexpr):
    """sum_k x[k] * W[r, k] / scale_2 for the decoded tile of `whole_k_tile` and one x row at p_xr -> fp32 [R]."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x_lanes(p_xr, KW)
    return dot_lanes(d0, d1, d2, d3, d4, d5, d6, d7, b_s, x0, x1, x2, x3, x4, x5, x6, x7, KW, BLOCK_R)


@triton.jit
def rows_dot_whole_k(p_w, p_s, o_r, m_r, stride_wr, stride_sr, p_xr, KW: tl.constexpr, BLOCK_R: tl.constexpr,
                     ASM: tl.constexpr = False, HALF: tl.constexpr = False):
    """`nvfp4_rows_dot` for one x row at p_xr when a row's K / 8 = KW words (a power of two) fit one
    tile: no loop, x read and split once -> fp32 [BLOCK_R]. Measured faster than the K loop on the
    decode shapes (bench/RESULTS.md). x is loaded before the weights so that both are in flight
    together (loading it after the decode, as `whole_k_row` does, measured 1.4-1.7x slower here).
    HALF: each block's products summed in fp16 (`dot_words_half`)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = x_lanes(p_xr, KW)
    b_w, b_sb = load_whole_k(p_w, p_s, o_r, m_r, stride_wr, stride_sr, KW)
    return dot_whole_k(b_w, b_sb, x0, x1, x2, x3, x4, x5, x6, x7, KW, BLOCK_R, ASM, HALF)
