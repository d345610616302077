"""The inner loops of the paged decode attention (details module of `ft.kernels.attention.kernel`,
whose kernels call them): q's load, a K/V tile's load, one block's tokens and online-softmax step,
and the walk over a sequence's tokens for each cache format, every one inlined into its caller.

* `attend`: whole K and V tiles in q's dtype (`load_kv_tile`: bf16/fp16/fp32 as stored, fp8 and
  NVFP4 dequantized exactly), two `tl.dot`s per block.
* `attend_nvfp4` (the NVFP4 default): q's even and odd columns against the low and high nibbles
  of each code byte, no per-tile interleave (11-14% faster on the H200: bench/RESULTS.md).
Each returns (max [BLOCK_G] in log2 units, sum [BLOCK_G], unnormalized acc [BLOCK_G, BLOCK_D]) in
fp32 over tokens [lo, hi) of one sequence and kv head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.kernels.nvfp4.decode import e2m1_hi, e2m1_lo, e4m3_f32, dequant_tile, e2m1_halves_f16_scaled, words_tile_f16

__all__ = ["attend", "attend_nvfp4", "d_mask", "load_q", "load_kv_tile", "nvfp4_tile_f16",
           "nvfp4_tile_f16_words"]


@triton.jit
def load_q(p_q, i_b, i_kv, G, D, stride_qb, stride_qh, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
            EVEN_D: tl.constexpr = False):
    """The query heads of kv head i_kv's group for sequence i_b -> [BLOCK_G, BLOCK_D] (padding rows 0).
    EVEN_D: D == BLOCK_D (`d_mask`)."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_gd = d_mask(o_g < G, o_d, D, EVEN_D)
    return tl.load(p_q + i_b * stride_qb + (i_kv * G + o_g)[:, None] * stride_qh + o_d[None, :], mask=m_gd, other=0.0)


@triton.jit
def d_mask(m_rows, o_d, D, EVEN_D: tl.constexpr):
    """The mask of a [rows, BLOCK_D] tile whose rows are m_rows and columns o_d < D. EVEN_D (the
    caller knows D == BLOCK_D): the rows alone, broadcast along D, so that the compiler vectorizes
    the row's loads and stores (16 bytes per thread); a mask against the runtime D makes every
    element a load of its own."""
    if EVEN_D:
        return m_rows[:, None]
    else:
        return m_rows[:, None] & (o_d < D)[None, :]


@triton.jit
def nvfp4_tile_f16(p, o_row, m_n, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr = False,
                   WORDS: tl.constexpr = False):
    """The K or V rows of BLOCK_N tokens of an NVFP4 cache -> [BLOCK_N, BLOCK_D] float16, exact and
    without the layer scale (`load_kv_tile`'s contract), decoded in fp16 throughout: each nibble's
    E4M3 bits (value times 2**-6) to fp16, times its block's scale times 64 in fp16. Exact: a code
    (2 significant bits) times an E4M3 scale (4) has at most 6 significant bits, within fp16's 11,
    and lies in [2**-10, 2,688] or is 0, inside fp16's normal range. Cheaper than the fp32 decode
    that `dequant_tile` runs for a bf16 tile (no fp16 -> fp32 -> bf16 round trip per element), for
    kernels that take their dot in fp16. WORDS: `nvfp4_tile_f16_words` (its conditions hold)."""
    if WORDS:
        return nvfp4_tile_f16_words(p, o_row, m_n, D, BLOCK_N, BLOCK_D)
    HALF: tl.constexpr = BLOCK_D // 2
    GROUPS: tl.constexpr = BLOCK_D // 16
    o_b = tl.arange(0, HALF)
    b_w = tl.load(p + o_row[:, None] + o_b[None, :], mask=d_mask(m_n, o_b, D // 2, EVEN_D), other=0)
    o_s = tl.arange(0, GROUPS)
    b_s = tl.load(p + o_row[:, None] + D // 2 + o_s[None, :], mask=d_mask(m_n, o_s, D // 16, EVEN_D), other=0)
    b_s = b_s.to(tl.float8e4nv, bitcast=True).to(tl.float16) * 64.0
    b_lo = (((b_w & 0x08) << 4) | ((b_w & 0x07) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b_hi = ((b_w & 0x80) | ((b_w >> 2) & 0x1C)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b_dec = tl.reshape(tl.join(b_lo, b_hi), (BLOCK_N, BLOCK_D))  # elements 2j, 2j + 1 of byte j
    return b_dec * tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_N, GROUPS, 16)), (BLOCK_N, BLOCK_D))


@triton.jit
def nvfp4_tile_f16_words(p, o_row, m_n, D, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """`nvfp4_tile_f16` with the codes read and turned into E4M3 bits a 32-bit word (8 codes) at a
    time (`ft.kernels.nvfp4.decode.words_tile_f16`; Triton runs uint8 arithmetic one byte per
    instruction). Needs D == BLOCK_D and D % 64 == 0 (a row of D/2 + D/16 bytes is then whole
    words, and o_row a multiple of 4 bytes)."""
    return words_tile_f16(p, p + D // 2, o_row, o_row, m_n, 0, BLOCK_N, BLOCK_D)


@triton.jit
def load_kv_tile(p, o_row, m_n, D, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 KV_FP8: tl.constexpr, KV_NVFP4: tl.constexpr, EVEN_D: tl.constexpr = False,
                 NVFP4_F16: tl.constexpr = False, NVFP4_WORDS: tl.constexpr = False):
    """The K or V rows of BLOCK_N tokens of one kv head -> [BLOCK_N, BLOCK_D] in `dtype`, without the
    layer scale (exact for quantized caches); masked tokens (m_n false) and columns >= D give 0.
    KV_NVFP4 with NVFP4_F16: in float16 whatever `dtype` (`nvfp4_tile_f16`, NVFP4_WORDS its WORDS).

    p: the kv head's cache (uint8 for KV_FP8 / KV_NVFP4); o_row [BLOCK_N] int64: each token's row
    offset from p in elements (page * stride_p + slot * stride_s); D: the head dim. KV_NVFP4: a row
    is D/2 code bytes then D/16 e4m3 block scales (`reference.py`). EVEN_D: D == BLOCK_D (`d_mask`)."""
    if KV_NVFP4 and NVFP4_F16:
        b_t = nvfp4_tile_f16(p, o_row, m_n, D, BLOCK_N, BLOCK_D, EVEN_D, NVFP4_WORDS)
    elif KV_NVFP4:
        b_t = dequant_tile(p, p + D // 2, o_row, m_n, 1, 1, 0, D // 2, dtype, BLOCK_N, BLOCK_D, EVEN_D)
    else:
        o_d = tl.arange(0, BLOCK_D)
        b_t = tl.load(p + o_row[:, None] + o_d[None, :], mask=d_mask(m_n, o_d, D, EVEN_D), other=0)
        if KV_FP8:
            b_t = b_t.to(tl.float8e4nv, bitcast=True)
        b_t = b_t.to(dtype)
    return b_t


@triton.jit
def _block_tokens(p_pt, n0, hi, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens [n0, n0 + BLOCK_N) of a sequence whose page-table row is p_pt: (in range [BLOCK_N],
    page id int64 [BLOCK_N], slot in the page [BLOCK_N]); tokens at or past hi read no page id."""
    o_n = n0 + tl.arange(0, BLOCK_N)
    m_n = o_n < hi
    return m_n, tl.load(p_pt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64), o_n % PAGE_SIZE


@triton.jit
def _softmax_block(b_s, m_n, b_m):
    """One block of the online softmax: scores b_s [G, N] (log2 units, scale included; tokens
    outside m_n become -inf) against the running max b_m [G] -> (new max, the factor that rescales
    what was summed before, exp2 of the block's scores [G, N]). Every block holds a token below hi,
    so the new max is finite and the padding rows stay finite."""
    b_s = tl.where(m_n[None, :], b_s, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    return b_m_new, tl.exp2(b_m - b_m_new), tl.exp2(b_s - b_m_new[:, None])


@triton.jit
def attend(b_q, p_k, p_v, p_pt, lo, hi, D, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
            PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False, KV_NVFP4: tl.constexpr = False,
            EVEN_D: tl.constexpr = False, NVFP4_F16: tl.constexpr = False, NVFP4_WORDS: tl.constexpr = False):
    """Online softmax of the group's queries b_q over tokens [lo, hi) of one sequence -> (max [BLOCK_G]
    in log2 units, sum [BLOCK_G], unnormalized acc [BLOCK_G, BLOCK_D]), fp32.

    p_k, p_v: the kv head's K/V cache (token (page, slot) at + page * stride_*p + slot * stride_*s);
    p_pt: the sequence's page-table row. Only tokens in [lo, hi) are loaded, their page ids included.
    KV_FP8 / KV_NVFP4: quantized caches (uint8, `load_kv_tile`); the caller folds the K scale into
    qk_scale and applies the V scale to the result (the tiles in q's dtype are exact).
    NVFP4_F16 (KV_NVFP4): q rounded to fp16 once and both dots in fp16 over tiles decoded in fp16
    (`load_kv_tile`'s NVFP4_F16; fp32 accumulation; |q| must lie inside fp16's range)."""
    if KV_NVFP4 and NVFP4_F16:
        b_q = b_q.to(tl.float16)
    b_m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    b_l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    b_acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        m_n, b_page, o_slot = _block_tokens(p_pt, n0, hi, PAGE_SIZE, BLOCK_N)
        b_k = load_kv_tile(p_k, b_page * stride_kp + o_slot * stride_ks, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D, KV_FP8,
                           KV_NVFP4, EVEN_D, NVFP4_F16, NVFP4_WORDS)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        b_m_new, b_alpha, b_p = _softmax_block(b_s, m_n, b_m)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_v = load_kv_tile(p_v, b_page * stride_vp + o_slot * stride_vs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D, KV_FP8,
                           KV_NVFP4, EVEN_D, NVFP4_F16, NVFP4_WORDS)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v, input_precision=PRECISION)
        b_m = b_m_new
    return b_m, b_l, b_acc


@triton.jit
def _nvfp4_halves(p, o_row, m_n, D, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  EVEN_D: tl.constexpr = False, F16: tl.constexpr = False, ASM: tl.constexpr = False):
    """The K or V rows of BLOCK_N tokens of an NVFP4 cache -> (even, odd) [BLOCK_N, BLOCK_D // 2] in
    `dtype`: elements 2j and 2j + 1 of each row (the low and the high nibble of code byte j) times
    their block's e4m3 scale, without the layer scale (exact, as `load_kv_tile`); masked tokens and
    columns >= D give 0. No interleaving: the caller splits q (and its output) into even and odd
    columns instead, once per program rather than once per tile. EVEN_D: D == BLOCK_D (`d_mask`).
    F16: the halves in float16 whatever `dtype`, times 2**-HALVES_SCALED_EXPONENT, decoded straight
    to fp16 (`e2m1_halves_f16_scaled`, by inline PTX where ASM) from each byte and its block's scale byte."""
    HALF: tl.constexpr = BLOCK_D // 2
    GROUPS: tl.constexpr = BLOCK_D // 16
    o_b = tl.arange(0, HALF)
    b_w = tl.load(p + o_row[:, None] + o_b[None, :], mask=d_mask(m_n, o_b, D // 2, EVEN_D), other=0)
    o_s = tl.arange(0, GROUPS)
    b_sb = tl.load(p + o_row[:, None] + D // 2 + o_s[None, :], mask=d_mask(m_n, o_s, D // 16, EVEN_D), other=0)
    if F16:
        b_sw = tl.reshape(tl.broadcast_to(b_sb[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))  # byte j: j // 8
        return e2m1_halves_f16_scaled(b_w, b_sw, ASM)
    b_s = e4m3_f32(b_sb) * 64.0  # (the nibble decode gives values times 2**-6)
    b_lo = tl.reshape(e2m1_lo(b_w), (BLOCK_N, GROUPS, 8)) * b_s[:, :, None]  # 8 bytes = one 16-element block
    b_hi = tl.reshape(e2m1_hi(b_w), (BLOCK_N, GROUPS, 8)) * b_s[:, :, None]
    return tl.reshape(b_lo, (BLOCK_N, HALF)).to(dtype), tl.reshape(b_hi, (BLOCK_N, HALF)).to(dtype)


@triton.jit
def attend_nvfp4(b_q, p_k, p_v, p_pt, lo, hi, D, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
                  PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr, EVEN_D: tl.constexpr = False, F16: tl.constexpr = False,
                  ASM: tl.constexpr = False):
    """`attend` over an NVFP4 cache with q split into its even and odd columns: q.k is the sum of
    two dots (even columns against the low nibbles, odd against the high), p.V fills an even and an
    odd accumulator, joined once at the end. Same contract and results as `attend` (the same
    products, in another order of summation). BLOCK_D >= 32 (each half a dot's K of >= 16).
    F16 (`NVFP4_PRMT`): q rounded to fp16 once and both dots in fp16 over halves decoded straight to
    fp16 (`_nvfp4_halves`' F16, inline PTX where ASM; fp32 accumulation; |q| inside fp16's range).
    The halves' power of two (2**-HALVES_SCALED_EXPONENT) goes into the softmax scale and the
    returned acc in fp32, exactly: the same bits as halves decoded unscaled."""
    HALF: tl.constexpr = BLOCK_D // 2
    UNSCALE: tl.constexpr = 64.0  # 2**HALVES_SCALED_EXPONENT (a jit function reads no plain global)
    if F16:
        b_q = b_q.to(tl.float16)
        qk_scale = qk_scale * UNSCALE
    b_qe, b_qo = tl.split(tl.reshape(b_q, (BLOCK_G, HALF, 2)))
    b_m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    b_l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    b_acc_e = tl.zeros((BLOCK_G, HALF), dtype=tl.float32)
    b_acc_o = tl.zeros((BLOCK_G, HALF), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        m_n, b_page, o_slot = _block_tokens(p_pt, n0, hi, PAGE_SIZE, BLOCK_N)
        b_ke, b_ko = _nvfp4_halves(p_k, b_page * stride_kp + o_slot * stride_ks, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D,
                                   EVEN_D, F16, ASM)
        b_s = tl.dot(b_qe, tl.trans(b_ke), input_precision=PRECISION)
        b_s = tl.dot(b_qo, tl.trans(b_ko), b_s, input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        b_m_new, b_alpha, b_p = _softmax_block(b_s, m_n, b_m)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_ve, b_vo = _nvfp4_halves(p_v, b_page * stride_vp + o_slot * stride_vs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D,
                                   EVEN_D, F16, ASM)
        b_pq = b_p.to(b_q.dtype)
        b_acc_e = tl.dot(b_pq, b_ve, b_acc_e * b_alpha[:, None], input_precision=PRECISION)
        b_acc_o = tl.dot(b_pq, b_vo, b_acc_o * b_alpha[:, None], input_precision=PRECISION)
        b_m = b_m_new
    b_acc = tl.reshape(tl.join(b_acc_e, b_acc_o), (BLOCK_G, BLOCK_D))
    if F16:
        b_acc = b_acc * UNSCALE
    return b_m, b_l, b_acc
