"""The inner loops of the paged decode attention (details module of `ft.kernels.attention.kernel`,
whose kernels call them): q's load, a K/V tile's load, one block's tokens and online-softmax step,
and the walk over a sequence's tokens for each cache format, every one inlined into its caller.

* `_attend`: whole K and V tiles in q's dtype (`load_kv_tile`: bf16/fp16/fp32 as stored, fp8 and
  NVFP4 dequantized exactly), two `tl.dot`s per block.
* `_attend_nvfp4` (the NVFP4 default): q's even and odd columns against the low and high nibbles
  of each code byte, no per-tile interleave (11-14% faster on the H200: bench/RESULTS.md).
* `_attend_nvfp4_fma` (off until measured): the codes as 32-bit words on the CUDA cores, q and the
  output in 8 lanes, one [G, N, W] layout family.
Each returns (max [BLOCK_G] in log2 units, sum [BLOCK_G], unnormalized acc [BLOCK_G, BLOCK_D]) in
fp32 over tokens [lo, hi) of one sequence and kv head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ft.kernels.nvfp4.decode import (
    _byte_f32, _e2m1_hi, _e2m1_lo, _e4m3, _hi_e4m3_word, _join8, _lo_e4m3_word, _split8, dequant_tile,
    e2m1_halves_f16_scaled, words_tile_f16,
)

__all__ = ["_attend", "_attend_nvfp4", "_attend_nvfp4_fma", "_d_mask", "_load_q", "load_kv_tile", "nvfp4_tile_f16",
           "nvfp4_tile_f16_words"]


@triton.jit
def _load_q(p_q, i_b, i_kv, G, D, stride_qb, stride_qh, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
            EVEN_D: tl.constexpr = False):
    """The query heads of kv head i_kv's group for sequence i_b -> [BLOCK_G, BLOCK_D] (padding rows 0).
    EVEN_D: D == BLOCK_D (`_d_mask`)."""
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_gd = _d_mask(o_g < G, o_d, D, EVEN_D)
    return tl.load(p_q + i_b * stride_qb + (i_kv * G + o_g)[:, None] * stride_qh + o_d[None, :], mask=m_gd, other=0.0)


@triton.jit
def _d_mask(m_rows, o_d, D, EVEN_D: tl.constexpr):
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
    b_w = tl.load(p + o_row[:, None] + o_b[None, :], mask=_d_mask(m_n, o_b, D // 2, EVEN_D), other=0)
    o_s = tl.arange(0, GROUPS)
    b_s = tl.load(p + o_row[:, None] + D // 2 + o_s[None, :], mask=_d_mask(m_n, o_s, D // 16, EVEN_D), other=0)
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
    is D/2 code bytes then D/16 e4m3 block scales (`reference.py`). EVEN_D: D == BLOCK_D (`_d_mask`)."""
    if KV_NVFP4 and NVFP4_F16:
        b_t = nvfp4_tile_f16(p, o_row, m_n, D, BLOCK_N, BLOCK_D, EVEN_D, NVFP4_WORDS)
    elif KV_NVFP4:
        b_t = dequant_tile(p, p + D // 2, o_row, m_n, 1, 1, 0, D // 2, dtype, BLOCK_N, BLOCK_D, EVEN_D)
    else:
        o_d = tl.arange(0, BLOCK_D)
        b_t = tl.load(p + o_row[:, None] + o_d[None, :], mask=_d_mask(m_n, o_d, D, EVEN_D), other=0)
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
def _attend(b_q, p_k, p_v, p_pt, lo, hi, D, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
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
                  EVEN_D: tl.constexpr = False, F16: tl.constexpr = False, ASM: tl.constexpr = False,
                  FORM: tl.constexpr = 0):
    """The K or V rows of BLOCK_N tokens of an NVFP4 cache -> (even, odd) [BLOCK_N, BLOCK_D // 2] in
    `dtype`: elements 2j and 2j + 1 of each row (the low and the high nibble of code byte j) times
    their block's e4m3 scale, without the layer scale (exact, as `load_kv_tile`); masked tokens and
    columns >= D give 0. No interleaving: the caller splits q (and its output) into even and odd
    columns instead, once per program rather than once per tile. EVEN_D: D == BLOCK_D (`_d_mask`).
    F16: the halves in float16 whatever `dtype`, decoded straight to fp16 (`e2m1_halves_f16`, by
    inline PTX where ASM) from each byte and its block's scale byte; FORM: the decode's instruction
    form (`e2m1_halves_f16_scaled`: the F16 halves are then times 2**-halves_exponent(FORM))."""
    HALF: tl.constexpr = BLOCK_D // 2
    GROUPS: tl.constexpr = BLOCK_D // 16
    o_b = tl.arange(0, HALF)
    b_w = tl.load(p + o_row[:, None] + o_b[None, :], mask=_d_mask(m_n, o_b, D // 2, EVEN_D), other=0)
    o_s = tl.arange(0, GROUPS)
    b_sb = tl.load(p + o_row[:, None] + D // 2 + o_s[None, :], mask=_d_mask(m_n, o_s, D // 16, EVEN_D), other=0)
    if F16:
        b_sw = tl.reshape(tl.broadcast_to(b_sb[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))  # byte j: j // 8
        return e2m1_halves_f16_scaled(b_w, b_sw, ASM, FORM)
    b_s = _e4m3(b_sb) * 64.0  # (the nibble decode gives values times 2**-6)
    b_lo = tl.reshape(_e2m1_lo(b_w), (BLOCK_N, GROUPS, 8)) * b_s[:, :, None]  # 8 bytes = one 16-element block
    b_hi = tl.reshape(_e2m1_hi(b_w), (BLOCK_N, GROUPS, 8)) * b_s[:, :, None]
    return tl.reshape(b_lo, (BLOCK_N, HALF)).to(dtype), tl.reshape(b_hi, (BLOCK_N, HALF)).to(dtype)


@triton.jit
def _attend_nvfp4(b_q, p_k, p_v, p_pt, lo, hi, D, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
                  PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  PRECISION: tl.constexpr, EVEN_D: tl.constexpr = False, F16: tl.constexpr = False,
                  ASM: tl.constexpr = False, FORM: tl.constexpr = 0):
    """`_attend` over an NVFP4 cache with q split into its even and odd columns: q.k is the sum of
    two dots (even columns against the low nibbles, odd against the high), p.V fills an even and an
    odd accumulator, joined once at the end. Same contract and results as `_attend` (the same
    products, in another order of summation). BLOCK_D >= 32 (each half a dot's K of >= 16).
    F16 (`NVFP4_PRMT`): q rounded to fp16 once and both dots in fp16 over halves decoded straight to
    fp16 (`_nvfp4_halves`' F16, inline PTX where ASM; fp32 accumulation; |q| inside fp16's range).
    FORM (F16): the decode's instruction form; its power of two (`halves_exponent`) goes into the
    softmax scale and the returned acc in fp32, exactly (the same bits as FORM 0)."""
    HALF: tl.constexpr = BLOCK_D // 2
    if F16:
        b_q = b_q.to(tl.float16)
        if FORM == 1:  # HALVES_BITS: the halves are times 2**-14
            qk_scale = qk_scale * 16384.0
        elif FORM == 2:  # HALVES_CVT: times 2**-6
            qk_scale = qk_scale * 64.0
    b_qe, b_qo = tl.split(tl.reshape(b_q, (BLOCK_G, HALF, 2)))
    b_m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    b_l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    b_acc_e = tl.zeros((BLOCK_G, HALF), dtype=tl.float32)
    b_acc_o = tl.zeros((BLOCK_G, HALF), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        m_n, b_page, o_slot = _block_tokens(p_pt, n0, hi, PAGE_SIZE, BLOCK_N)
        b_ke, b_ko = _nvfp4_halves(p_k, b_page * stride_kp + o_slot * stride_ks, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D,
                                   EVEN_D, F16, ASM, FORM)
        b_s = tl.dot(b_qe, tl.trans(b_ke), input_precision=PRECISION)
        b_s = tl.dot(b_qo, tl.trans(b_ko), b_s, input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        b_m_new, b_alpha, b_p = _softmax_block(b_s, m_n, b_m)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_ve, b_vo = _nvfp4_halves(p_v, b_page * stride_vp + o_slot * stride_vs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D,
                                   EVEN_D, F16, ASM, FORM)
        b_pq = b_p.to(b_q.dtype)
        b_acc_e = tl.dot(b_pq, b_ve, b_acc_e * b_alpha[:, None], input_precision=PRECISION)
        b_acc_o = tl.dot(b_pq, b_vo, b_acc_o * b_alpha[:, None], input_precision=PRECISION)
        b_m = b_m_new
    b_acc = tl.reshape(tl.join(b_acc_e, b_acc_o), (BLOCK_G, BLOCK_D))
    if F16 and FORM == 1:
        b_acc = b_acc * 16384.0
    elif F16 and FORM == 2:
        b_acc = b_acc * 64.0
    return b_m, b_l, b_acc


@triton.jit
def _pv_lane(b_a, b_p, b_e, I: tl.constexpr, b_sc, b_alpha):
    """One lane's p.V update, all [G, N, W]-family tensors: b_a [G, 1, W] rescaled by b_alpha
    [G, 1, 1] plus the sum over tokens of p [G, N, 1] times byte I of the E4M3 words b_e
    [1, N, W] (one nibble of each word) times the block scales b_sc [1, N, W]."""
    return b_a * b_alpha + tl.sum(b_p * (_byte_f32(b_e, I) * b_sc), axis=1, keep_dims=True)


@triton.jit
def _attend_nvfp4_fma(b_q, p_k, p_v, p_pt, lo, hi, D, qk_scale, stride_kp, stride_ks, stride_vp, stride_vs,
                      PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """`_attend` over an NVFP4 cache on the CUDA cores, no `tl.dot`: the codes read as 32-bit words
    and decoded a word at a time (as the small-batch GEMV), q.k and p.V in fp32 with q and the
    output in 8 lanes (element 8w + j), joined once at the end. A GQA group has G = 8 rows or
    fewer, too few for a tensor-core tile (no padding rows here). Every tensor of the loop is of
    one [G, N, W] family (reductions keep their dims), so that the compiler needs no layout
    conversion inside it. Same contract as `_attend`; the products in fp32 (q is not rounded).
    Needs D == BLOCK_D (no mask along a row: the word loads vectorize, 16 bytes per thread) and
    D % 64 == 0 (a row of D/2 + D/16 bytes is then whole words). NOT YET MEASURED on a GPU: off by
    default (`NVFP4_FMA`); compiled for sm_90 with 4 warps the V side's sum over tokens crosses
    warps (shared memory, ~200 barriers a tile), with 1 warp it does not (bench/decode_attention.py
    --extra, with more splits, is the next measurement)."""
    W: tl.constexpr = BLOCK_D // 8
    q0, q1, q2, q3, q4, q5, q6, q7 = _split8(tl.reshape(b_q.to(tl.float32), (BLOCK_G, W, 8)), BLOCK_G, W)
    q0, q1, q2, q3 = q0[:, None, :], q1[:, None, :], q2[:, None, :], q3[:, None, :]  # [G, 1, W]
    q4, q5, q6, q7 = q4[:, None, :], q5[:, None, :], q6[:, None, :], q7[:, None, :]
    o_w = tl.arange(0, W)[None, None, :]  # [1, 1, W] (BLOCK_D == D: no mask along a row, so loads vectorize)
    p_kw = p_k.to(tl.pointer_type(tl.int32))
    p_vw = p_v.to(tl.pointer_type(tl.int32))
    b_m = tl.full((BLOCK_G, 1, 1), float("-inf"), dtype=tl.float32)
    b_l = tl.zeros((BLOCK_G, 1, 1), dtype=tl.float32)
    a0 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    a4 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    a5 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    a6 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    a7 = tl.zeros((BLOCK_G, 1, W), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)[None, :, None]  # [1, N, 1]
        m_n = o_n < hi
        m_nw = m_n & (o_w >= 0)  # [1, N, W], constant along a row
        b_page = tl.load(p_pt + o_n // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
        o_slot = o_n % PAGE_SIZE
        o_k = b_page * stride_kp + o_slot * stride_ks  # bytes (multiples of 4: D % 64 == 0)
        b_kw = tl.load(p_kw + o_k // 4 + o_w, mask=m_nw, other=0).to(tl.uint32, bitcast=True)  # [1, N, W]
        b_ks = _e4m3(tl.load(p_k + o_k + D // 2 + o_w // 2, mask=m_nw, other=0))
        k_lo = _lo_e4m3_word(b_kw)
        k_hi = _hi_e4m3_word(b_kw)
        b_t = _byte_f32(k_lo, 0) * q0 + _byte_f32(k_hi, 0) * q1 + _byte_f32(k_lo, 1) * q2 + _byte_f32(k_hi, 1) * q3
        b_t += _byte_f32(k_lo, 2) * q4 + _byte_f32(k_hi, 2) * q5 + _byte_f32(k_lo, 3) * q6 + _byte_f32(k_hi, 3) * q7
        b_s = tl.sum(b_t * b_ks, axis=2, keep_dims=True) * (64.0 * qk_scale)  # [G, N, 1] (decode: x 2**-6)
        b_s = tl.where(m_n, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1, keep_dims=True))  # [G, 1, 1]
        b_alpha = tl.exp2(b_m - b_m_new)
        b_p = tl.exp2(b_s - b_m_new)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1, keep_dims=True)
        o_v = b_page * stride_vp + o_slot * stride_vs
        b_vw = tl.load(p_vw + o_v // 4 + o_w, mask=m_nw, other=0).to(tl.uint32, bitcast=True)
        b_vs = _e4m3(tl.load(p_v + o_v + D // 2 + o_w // 2, mask=m_nw, other=0))
        v_lo = _lo_e4m3_word(b_vw)
        v_hi = _hi_e4m3_word(b_vw)
        a0 = _pv_lane(a0, b_p, v_lo, 0, b_vs, b_alpha)
        a1 = _pv_lane(a1, b_p, v_hi, 0, b_vs, b_alpha)
        a2 = _pv_lane(a2, b_p, v_lo, 1, b_vs, b_alpha)
        a3 = _pv_lane(a3, b_p, v_hi, 1, b_vs, b_alpha)
        a4 = _pv_lane(a4, b_p, v_lo, 2, b_vs, b_alpha)
        a5 = _pv_lane(a5, b_p, v_hi, 2, b_vs, b_alpha)
        a6 = _pv_lane(a6, b_p, v_lo, 3, b_vs, b_alpha)
        a7 = _pv_lane(a7, b_p, v_hi, 3, b_vs, b_alpha)
        b_m = b_m_new
    G2: tl.constexpr = BLOCK_G
    acc = _join8(tl.reshape(a0, (G2, W)), tl.reshape(a1, (G2, W)), tl.reshape(a2, (G2, W)), tl.reshape(a3, (G2, W)),
                 tl.reshape(a4, (G2, W)), tl.reshape(a5, (G2, W)), tl.reshape(a6, (G2, W)), tl.reshape(a7, (G2, W)),
                 BLOCK_G, W)
    return tl.reshape(b_m, (BLOCK_G,)), tl.reshape(b_l, (BLOCK_G,)), acc * 64.0
