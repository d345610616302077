"""Triton kernels of the decode step over the paged KV cache (details module of `ft.kernels.attention`).

Everything a launch reads that changes from step to step is a device tensor (slot mapping, page
table, sequence lengths, q); grids and block sizes depend on shapes only; nothing syncs with the
host; the split-K workspace comes from the caller. So a decode step is capturable in a CUDA graph.

* `_write_kv_decode_kernel`: one program per sequence stores its new token's K and V [Hkv, D] at
  its slot (page * page_size + offset), quantized for an fp8 or NVFP4 cache; a negative slot
  (padding row) writes nothing.
* `_decode_kernel` (single pass): one program per (sequence, kv head) takes all G = Hq / Hkv query
  heads of the group at once, as a [BLOCK_G, D] tile (BLOCK_G >= 16 for ``tl.dot``), so K and V
  are read once per group. It walks the sequence in blocks of BLOCK_N tokens (a token's page id
  is gathered from the page table, so any page size works) with an online softmax in fp32
  (log2 units, the scale folded into the scores), masking tokens at or past seq_lens[b]: page
  table entries and KV slots past a sequence's length are never read.
* `_decode_split_kernel` + `_decode_combine_kernel` (split-K, long contexts): programs over
  (sequence, kv head, split); split s of S takes tokens [s * c, (s + 1) * c) with
  c = cdiv(cdiv(seq_len, S), BLOCK_N) * BLOCK_N from the actual length, and writes its partial
  (max, sum, unnormalized acc) to the workspace; the combine kernel, one program per
  (sequence, query head), rescales the S partials to their common max and normalizes.
  S comes from the caller or from the declared maximum context (`decode_tuning.decode_split_count`).

The optional output gate (HAS_GATE; Qwen3-Next's gated attention) is applied by the kernel that
writes the output, the single-pass or the combine kernel: o * sigmoid(gate) in fp32, rounded to the
output dtype once, which saves the model two elementwise launches per layer.

Quantized caches (formats and rounding: `reference.py`), a constexpr each, pointers as uint8:
KV_FP8 (float8_e4m3fn bits) and KV_NVFP4 (rows of D/2 bytes of E2M1 codes then D/16 e4m3 block
scales). The write kernel quantizes as the reference does, bit for bit for finite inputs (the e4m3
rounding done by hand, `_round_e4m3`, since the interpreter's fp32 -> fp8 conversion is wrong;
IEEE divisions); the attention kernels' inner loops (`decode_loops.py`) turn each K/V tile into
q's dtype (`load_kv_tile`; exact:
an fp8 value has 4 significant bits, an E2M1 value times an e4m3 block scale at most 6, within
bf16's and fp16's range), fold the layer's K scale into the softmax scale and apply its V scale
to the output. EVEN_D (D == BLOCK_D, set by the launchers) drops the tiles' column mask, so their
loads vectorize. An NVFP4 cache has three inner loops, a constexpr each, the first that is on wins
(a fourth, CUDA cores over 32-bit words, `NVFP4_FMA`, never measured to the end, was deleted in
session 23; `0c5cbf3` holds it): `NVFP4_PRMT` (the
default: q's even and odd columns against the low and high nibbles, each decoded straight to fp16
in inline PTX, `ft.kernels.nvfp4.decode.e2m1_halves_f16_scaled`, as E4M3 bytes converted two at a
time, values times 2**-6 undone in fp32 (the table's byte permutes, which named it, and the bits
placed lost to that form: bench/RESULTS.md session 16; they left after commit d98949c);
NVFP4_ASM is set on CUDA only, the interpreter runs a plain-Triton stand-in to the same values;
its split count aims at `DecodeAttentionOptions.prmt_programs_per_sm` programs an SM, held to
`.prmt_maxnreg` registers when over two; it needs D % 64 == 0 and a half-precision q),
`NVFP4_F16` (fp16 dots over whole tiles decoded byte-wise: the fallback for other head dims; its
word-at-a-time decode, shadowed here by NVFP4_PRMT, serves the prefill kernel only) and
`NVFP4_HALVES` (the halves decoded byte-wise in fp32, for fp32 queries); whole byte-wise tiles (`dequant_tile`) below head dim 32. The decode, not the loads, bounds
them: Triton runs uint8 arithmetic a byte per instruction. Measurements and block sizes:
bench/decode_attention.py, bench/RESULTS.md (sessions 10-16); the options that pick them:
`ft.kernels.options.DecodeAttentionOptions`, read by `decode_tuning.py` and here. A sequence of length 0 (a padding row)
gives zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.attention.reference import NVFP4_CACHE, cache_head_dim
import ft.kernels.attention.decode_tuning as tuning
from ft.kernels.backend import inline_ptx, sm_count
from ft.kernels.options import kernel_options
from ft.kernels.attention.split import DecodeWorkspace, decode_attention_workspace
from ft.kernels.attention.decode_loops import attend, attend_nvfp4, d_mask, load_q
from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["paged_decode_attention_triton", "write_kv_decode_triton"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
COMBINE_CHUNK_S = 16
"""Splits the decode combine reads at a time (a loop over them: few registers for any split count)."""


@triton.jit
def _round_e4m3(x):
    """fp32 x in [-448, 448] -> the nearest float8_e4m3fn value (ties to even), still fp32, so that
    the conversion that follows is exact. Done by hand: the interpreter's fp32 -> fp8 conversion
    drops the carry of a round-up (31.5 -> 16) and rounds ties up; the add-and-subtract of
    1.5 * 2**23 ulps rounds to the format's spacing in fp32 arithmetic (round to nearest even)."""
    ax = tl.abs(x)
    e = ((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # binade of |x| (-127 for 0)
    e = tl.maximum(e, -6)  # below 2**-6: the subnormals' fixed spacing 2**-9
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3): 3 mantissa bits
    magic = step * 12582912.0  # 1.5 * 2**23 * step: its ulp is step
    r = (ax + magic) - magic
    return tl.where(x < 0, -r, r)


@triton.jit
def _e2m1_code(y):
    """fp32 y (already divided by its scales) -> int32 E2M1 codes 0..15: the nearest E2M1 magnitude,
    ties to the even code, saturating above 5; sign bit (8) iff y < 0 (as `reference.py` encodes them)."""
    a = tl.abs(y)
    c = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
    c += (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return c | tl.where(y < 0, 8, 0)


@triton.jit
def _write_nvfp4_heads(p_x, stride_xh, p_c, stride_ch, ls, o_h, m_h, D, d_end, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Quantize heads o_h of one token (x at p_x + h * stride_xh + d, D elements) to NVFP4 rows at
    p_c + h * stride_ch (uint8: D/2 code bytes, then D/16 e4m3 block-scale bytes), layer scale ls
    (fp32); elements at or past d_end (D, or 0 for a padding row) are neither read nor written.
    The float32 operations and their order are `reference.quantize_nvfp4_kv`'s."""
    NB: tl.constexpr = BLOCK_D // 16
    o_b = tl.arange(0, NB)
    o_e = tl.arange(0, 8)
    o_x = (o_b * 16)[None, :, None] + 2 * o_e[None, None, :]  # [1, NB, 8]: element 2e of block b
    m = m_h[:, None, None] & (o_x < d_end)
    p_xt = p_x + o_h[:, None, None] * stride_xh + o_x
    b_xe = tl.load(p_xt, mask=m, other=0.0).to(tl.float32)  # even elements (low nibbles)
    b_xo = tl.load(p_xt + 1, mask=m, other=0.0).to(tl.float32)  # odd elements (high nibbles)
    b_amax = tl.maximum(tl.max(tl.abs(b_xe), axis=2), tl.max(tl.abs(b_xo), axis=2))  # [BLOCK_H, NB]
    b_s = tl.math.div_rn(b_amax, ls * 6.0)
    b_s = tl.where(b_s == 0, 1.0, b_s)
    b_s = _round_e4m3(tl.minimum(tl.maximum(b_s, 0.001953125), 448.0))  # clamped to [2**-9, 448]
    b_div = (b_s * ls)[:, :, None]
    b_code = _e2m1_code(tl.math.div_rn(b_xe, b_div)) | (_e2m1_code(tl.math.div_rn(b_xo, b_div)) << 4)
    p_ct = p_c + o_h[:, None, None] * stride_ch
    tl.store(p_ct + (o_b * 8)[None, :, None] + o_e[None, None, :], b_code.to(tl.uint8), mask=m)
    m_s = m_h[:, None] & (o_b * 16 < d_end)[None, :]
    tl.store(p_c + o_h[:, None] * stride_ch + D // 2 + o_b[None, :],
             b_s.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m_s)


@triton.jit
def _write_kv_decode_kernel(
    p_k, p_v, p_kc, p_vc, p_slot, p_kvs, H, D, page_size,
    stride_kb, stride_kh, stride_vb, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    p_x, p_xc, DX, stride_xb, stride_xcp, stride_xcs,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr = False, KV_NVFP4: tl.constexpr = False,
    PDL: tl.constexpr = False, EXTRA: tl.constexpr = False, BLOCK_X: tl.constexpr = 16,
):
    """KV_FP8: the cache is float8_e4m3fn (passed as its uint8 bits) holding x / scale, rounded to
    nearest even after clamping to +-448; p_kvs holds the layer's (K, V) scales. KV_NVFP4: the
    cache rows are NVFP4 (uint8, D/2 + D/16 bytes; D is the head dim), see `reference.py`. EXTRA: one
    more row a token, p_x's DX values, copied (cast) into the paged cache p_xc at the same slot (QSA's
    raw indexer keys)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_b = tl.program_id(0)
    slot = tl.load(p_slot + i_b).to(tl.int64)
    i_p = tl.maximum(slot, 0) // page_size
    i_s = tl.maximum(slot, 0) % page_size
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    d_end = tl.where(slot >= 0, D, 0)  # NOTE: a scalar bool in a mask fails in the interpreter
    if EXTRA:
        o_x = tl.arange(0, BLOCK_X)
        m_x = o_x < tl.where(slot >= 0, DX, 0)
        b_x = tl.load(p_x + i_b * stride_xb + o_x, mask=m_x)
        tl.store(p_xc + i_p * stride_xcp + i_s * stride_xcs + o_x, b_x.to(p_xc.dtype.element_ty), mask=m_x)
    if KV_NVFP4:
        m_h = o_h < H
        _write_nvfp4_heads(p_k + i_b * stride_kb, stride_kh, p_kc + i_p * stride_kcp + i_s * stride_kcs, stride_kch,
                           tl.load(p_kvs), o_h, m_h, D, d_end, BLOCK_H, BLOCK_D)
        _write_nvfp4_heads(p_v + i_b * stride_vb, stride_vh, p_vc + i_p * stride_vcp + i_s * stride_vcs, stride_vch,
                           tl.load(p_kvs + 1), o_h, m_h, D, d_end, BLOCK_H, BLOCK_D)
    else:
        m_hd = (o_h < H)[:, None] & (o_d < d_end)[None, :]
        b_k = tl.load(p_k + i_b * stride_kb + o_h[:, None] * stride_kh + o_d[None, :], mask=m_hd)
        b_v = tl.load(p_v + i_b * stride_vb + o_h[:, None] * stride_vh + o_d[None, :], mask=m_hd)
        p_kt = p_kc + i_p * stride_kcp + i_s * stride_kcs + o_h[:, None] * stride_kch + o_d[None, :]
        p_vt = p_vc + i_p * stride_vcp + i_s * stride_vcs + o_h[:, None] * stride_vch + o_d[None, :]
        if KV_FP8:
            # NOTE: div_rn: the IEEE quotient (as torch divides), not the fast approximate one
            b_k = tl.minimum(tl.maximum(tl.math.div_rn(b_k.to(tl.float32), tl.load(p_kvs)), -448.0), 448.0)
            b_v = tl.minimum(tl.maximum(tl.math.div_rn(b_v.to(tl.float32), tl.load(p_kvs + 1)), -448.0), 448.0)
            tl.store(p_kt, _round_e4m3(b_k).to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m_hd)
            tl.store(p_vt, _round_e4m3(b_v).to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m_hd)
        else:
            tl.store(p_kt, b_k.to(p_kc.dtype.element_ty), mask=m_hd)
            tl.store(p_vt, b_v.to(p_vc.dtype.element_ty), mask=m_hd)


@triton.jit
def _decode_kernel(
    p_q, p_kc, p_vc, p_pt, p_seq, p_g, p_o, p_kvs, qk_scale, G, D,
    stride_qb, stride_qh, stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    stride_ptb, stride_gb, stride_gh, stride_ob, stride_oh,
    PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, HAS_GATE: tl.constexpr, KV_FP8: tl.constexpr = False, KV_NVFP4: tl.constexpr = False,
    NVFP4_HALVES: tl.constexpr = False, EVEN_D: tl.constexpr = False,
    NVFP4_F16: tl.constexpr = False, NVFP4_PRMT: tl.constexpr = False, NVFP4_ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_b = tl.program_id(0)
    i_kv = tl.program_id(1)
    seq_len = tl.load(p_seq + i_b).to(tl.int32)
    b_q = load_q(p_q, i_b, i_kv, G, D, stride_qb, stride_qh, BLOCK_G, BLOCK_D, EVEN_D)
    if KV_FP8 or KV_NVFP4:
        qk_scale = qk_scale * tl.load(p_kvs)
    if KV_NVFP4 and NVFP4_PRMT:
        _, b_l, b_acc = attend_nvfp4(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch, p_pt + i_b * stride_ptb,
                                      0, seq_len, D, qk_scale, stride_kcp, stride_kcs, stride_vcp, stride_vcs,
                                      PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, EVEN_D, True, NVFP4_ASM)
    elif KV_NVFP4 and NVFP4_F16:
        _, b_l, b_acc = attend(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch, p_pt + i_b * stride_ptb,
                                0, seq_len, D, qk_scale, stride_kcp, stride_kcs, stride_vcp, stride_vcs,
                                PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, KV_FP8, KV_NVFP4, EVEN_D, True)
    elif KV_NVFP4 and NVFP4_HALVES:
        _, b_l, b_acc = attend_nvfp4(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch, p_pt + i_b * stride_ptb,
                                      0, seq_len, D, qk_scale, stride_kcp, stride_kcs, stride_vcp, stride_vcs,
                                      PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, EVEN_D)
    else:
        _, b_l, b_acc = attend(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch, p_pt + i_b * stride_ptb,
                                0, seq_len, D, qk_scale, stride_kcp, stride_kcs, stride_vcp, stride_vcs,
                                PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, KV_FP8, KV_NVFP4, EVEN_D)
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]  # seq_len 0: zeros
    if KV_FP8 or KV_NVFP4:
        b_o = b_o * tl.load(p_kvs + 1)
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_gd = d_mask(o_g < G, o_d, D, EVEN_D)
    if HAS_GATE:
        b_g = tl.load(p_g + i_b * stride_gb + (i_kv * G + o_g)[:, None] * stride_gh + o_d[None, :], mask=m_gd,
                      other=0.0)
        b_o = b_o * tl.sigmoid(b_g.to(tl.float32))
    p_ot = p_o + i_b * stride_ob + (i_kv * G + o_g)[:, None] * stride_oh + o_d[None, :]
    tl.store(p_ot, b_o.to(p_o.dtype.element_ty), mask=m_gd)


@triton.jit
def _decode_split_kernel(
    p_q, p_kc, p_vc, p_pt, p_seq, p_acc, p_st, p_kvs, qk_scale, G, D,
    stride_qb, stride_qh, stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
    stride_ptb, stride_ar, stride_ah, stride_sr, stride_sh,
    PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, KV_FP8: tl.constexpr = False, KV_NVFP4: tl.constexpr = False,
    NVFP4_HALVES: tl.constexpr = False, EVEN_D: tl.constexpr = False,
    NVFP4_F16: tl.constexpr = False, NVFP4_PRMT: tl.constexpr = False, NVFP4_ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_b = tl.program_id(0)
    i_kv = tl.program_id(1)
    i_s = tl.program_id(2)
    n_s = tl.num_programs(2)
    seq_len = tl.load(p_seq + i_b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, n_s), BLOCK_N) * BLOCK_N
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, seq_len)  # lo >= hi: an empty split (max -inf, sum 0, acc 0)
    b_q = load_q(p_q, i_b, i_kv, G, D, stride_qb, stride_qh, BLOCK_G, BLOCK_D, EVEN_D)
    if KV_FP8 or KV_NVFP4:
        qk_scale = qk_scale * tl.load(p_kvs)
    if KV_NVFP4 and NVFP4_PRMT:
        b_m, b_l, b_acc = attend_nvfp4(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch,
                                        p_pt + i_b * stride_ptb, lo, hi, D, qk_scale, stride_kcp, stride_kcs,
                                        stride_vcp, stride_vcs, PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, EVEN_D,
                                        True, NVFP4_ASM)
    elif KV_NVFP4 and NVFP4_F16:
        b_m, b_l, b_acc = attend(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch, p_pt + i_b * stride_ptb,
                                  lo, hi, D, qk_scale, stride_kcp, stride_kcs, stride_vcp, stride_vcs,
                                  PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, KV_FP8, KV_NVFP4, EVEN_D, True)
    elif KV_NVFP4 and NVFP4_HALVES:
        b_m, b_l, b_acc = attend_nvfp4(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch,
                                        p_pt + i_b * stride_ptb, lo, hi, D, qk_scale, stride_kcp, stride_kcs,
                                        stride_vcp, stride_vcs, PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, EVEN_D)
    else:
        b_m, b_l, b_acc = attend(b_q, p_kc + i_kv * stride_kch, p_vc + i_kv * stride_vch, p_pt + i_b * stride_ptb,
                                  lo, hi, D, qk_scale, stride_kcp, stride_kcs, stride_vcp, stride_vcs,
                                  PAGE_SIZE, BLOCK_G, BLOCK_N, BLOCK_D, PRECISION, KV_FP8, KV_NVFP4, EVEN_D)
    if KV_FP8 or KV_NVFP4:
        b_acc = b_acc * tl.load(p_kvs + 1)
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    o_h = i_kv * G + o_g
    i_r = i_b * n_s + i_s
    tl.store(p_acc + i_r * stride_ar + o_h[:, None] * stride_ah + o_d[None, :], b_acc, mask=d_mask(m_g, o_d, D, EVEN_D))
    tl.store(p_st + i_r * stride_sr + o_h * stride_sh, b_m, mask=m_g)
    tl.store(p_st + i_r * stride_sr + o_h * stride_sh + 1, b_l, mask=m_g)


# NOTE: S is not specialized and sizes no block: one compile serves every split count (a mixed step's eager decode
# rows take theirs from their contexts; session 60 saw this kernel compile at c10 through `ft serve` when a block
# was the splits' next power of two)
@triton.jit(do_not_specialize=["S"])
def _decode_combine_kernel(
    p_acc, p_st, p_g, p_o, S, D, stride_ar, stride_ah, stride_sr, stride_sh, stride_gb, stride_gh, stride_ob,
    stride_oh, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    # grid (B, Hq, cdiv(D, BLOCK_D)): columns apart, so that a long context's many splits are read by
    # enough programs (`COMBINE_BLOCK_D`); every column's sum is the same whatever the block
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    p_sb = p_st + i_b * S * stride_sr + i_h * stride_sh
    p_ab = p_acc + i_b * S * stride_ar + i_h * stride_ah
    b_maxes = tl.full((CHUNK_S,), float("-inf"), dtype=tl.float32)
    for s0 in range(0, S, CHUNK_S):  # the splits' maximum, CHUNK_S at a time (S is not a compile-time size)
        o_c = s0 + tl.arange(0, CHUNK_S)
        b_maxes = tl.maximum(b_maxes, tl.load(p_sb + o_c * stride_sr, mask=o_c < S, other=float("-inf")))
    b_max = tl.max(b_maxes, axis=0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)  # seq_len 0: every split empty
    o_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_sum = tl.zeros((CHUNK_S,), dtype=tl.float32)
    b_o = tl.zeros((CHUNK_S, BLOCK_D), dtype=tl.float32)
    for s0 in range(0, S, CHUNK_S):  # CHUNK_S rows of acc at a time: few registers for any split count
        o_c = s0 + tl.arange(0, CHUNK_S)
        m_c = o_c < S
        b_w = tl.exp2(tl.load(p_sb + o_c * stride_sr, mask=m_c, other=float("-inf")) - b_max)  # empty splits: 0
        b_sum += b_w * tl.load(p_sb + o_c * stride_sr + 1, mask=m_c, other=0.0)
        # an empty split (or one whose weight underflows) adds nothing: its row is not read (at a short context
        # most of a long limit's splits are empty)
        m_w = m_c & (b_w > 0)
        b_acc = tl.load(p_ab + o_c[:, None] * stride_ar + o_d[None, :], mask=m_w[:, None] & m_d[None, :], other=0.0)
        b_o += b_w[:, None] * b_acc
    b_l = tl.sum(b_sum, axis=0)
    b_out = tl.sum(b_o, axis=0) / tl.where(b_l > 0, b_l, 1.0)  # seq_len 0: zeros
    if HAS_GATE:
        b_g = tl.load(p_g + i_b * stride_gb + i_h * stride_gh + o_d, mask=m_d, other=0.0)
        b_out = b_out * tl.sigmoid(b_g.to(tl.float32))
    tl.store(p_o + i_b * stride_ob + i_h * stride_oh + o_d, b_out.to(p_o.dtype.element_ty), mask=m_d)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Checks the caches' shapes and layout -> the head dim D (`reference.cache_head_dim`)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache, v_cache must be [P, page_size, Hkv, D] alike, got {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}, {tuple(v_cache.shape)} {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache, v_cache must be contiguous along D")
    return cache_head_dim(k_cache)


def kv_args(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scale: torch.Tensor | None, any_ptr: torch.Tensor):
    """(k_cache, v_cache, scales, {"KV_FP8": .., "KV_NVFP4": ..}) as the kernels take them: an fp8
    cache as its uint8 bits, an NVFP4 cache (uint8) as is, either with its float32 [2] (K, V)
    scales; any other cache as is (scales: any pointer, never read)."""
    fp8, nvfp4 = k_cache.dtype == torch.float8_e4m3fn, k_cache.dtype == NVFP4_CACHE
    if not (fp8 or nvfp4):
        return k_cache, v_cache, any_ptr, {"KV_FP8": False, "KV_NVFP4": False}
    if kv_scale is None or kv_scale.numel() != 2 or kv_scale.dtype != torch.float32 or kv_scale.stride(-1) != 1:
        raise ValueError(f"an {'fp8' if fp8 else 'NVFP4'} KV cache needs kv_scale: float32 [2] (the layer's K and "
                         "V scales)")
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), kv_scale, {"KV_FP8": fp8, "KV_NVFP4": nvfp4}


def write_kv_decode_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None, extra: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`write_kv_decode_ref` on Triton: k, v [B, Hkv, D] into k_cache, v_cache [P, page_size, Hkv, R]
    (R = D, or D/2 + D/16 for an NVFP4 cache; any strides but the last) at slot_mapping [B] int64;
    negative slots write nothing; an fp8 or NVFP4 cache quantizes with kv_scale (float32 [2]: K,
    V) exactly as `write_kv_decode_ref` (bit for bit). extra: (cache [P, page_size, X] with unit
    stride along X, rows [B, X] with unit stride along X): each token's row also copied (cast) into
    that paged cache at its slot (QSA's raw indexer keys: `write_slots`' result, in this launch).

    Raises: ValueError on shapes that do not match, or a quantized cache without kv_scale."""
    cache_d = check_cache(k_cache, v_cache)
    b, h, d = k.shape
    if v.shape != k.shape or (k_cache.shape[2], cache_d) != (h, d) or tuple(slot_mapping.shape) != (b,):
        raise ValueError(f"shapes do not match: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}, "
                         f"slot_mapping {tuple(slot_mapping.shape)}")
    if extra is not None:
        xc, rows = extra
        if (xc.dim() != 3 or rows.dim() != 2 or xc.shape[1] != k_cache.shape[1] or rows.shape != (b, xc.shape[2])
                or xc.stride(-1) != 1 or rows.stride(-1) != 1):
            raise ValueError(f"extra must be a paged cache [P, {k_cache.shape[1]}, X] and rows [{b}, X] with unit "
                             f"stride along X, got {tuple(xc.shape)} and {tuple(rows.shape)}")
        extra_args = (rows, xc, xc.shape[2], rows.stride(0), xc.stride(0), xc.stride(1))
        extra_flags = {"EXTRA": True, "BLOCK_X": triton.next_power_of_2(xc.shape[2])}
    else:
        extra_args, extra_flags = (k, k, 0, 0, 0, 0), {}
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    k_cache, v_cache, kvs, kv_flags = kv_args(k_cache, v_cache, kv_scale, k)
    if b:
        _write_kv_decode_kernel[(b,)](
            k, v, k_cache, v_cache, slot_mapping, kvs, h, d, k_cache.shape[1],
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
            v_cache.stride(2), *extra_args,
            BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d), **kv_flags, **extra_flags,
            num_warps=4, **pdl_args(k.device))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    config: dict | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_decode_attention_ref` on Triton: q [B, Hq, D] -> [B, Hq, D] in q's dtype.

    Args:
        max_seq_len: the longest context the caller declares (default: the page table's capacity,
            max_pages * page_size); picks the split count (`decode_tuning.decode_split_count`).
        splits: force a split count (1: the single-pass kernel).
        workspace: the split-K workspace (`decode_attention_workspace`), at least B * splits rows;
            allocated here when missing. Pass one allocated up front when capturing a CUDA graph.
        out: optional [B, Hq, D] output in q's dtype (written entirely).
        gate: optional output gate [B, Hq, D] in q's dtype, any strides (a view of the q projection
            reads in place; copied only when D's stride is not 1): the output is o * sigmoid(gate) in
            fp32, rounded once, by the single-pass or the combine kernel.
        config: block sizes and launch options overriding `decode_tuning.decode_config` (tests, benchmarks), and
            COMBINE_BLOCK_D, the combine's columns per program (default `DecodeAttentionOptions.combine_block_d`).
        kv_scale: float32 [2] (K, V) scales of an fp8 or NVFP4 cache (required then; k_cache, v_cache
            [P, page_size, Hkv, D/2 + D/16] uint8 for NVFP4): K's is folded into the softmax scale,
            V's applied to the output.
    Raises:
        ValueError: on shapes, dtypes or layouts the kernels do not take, or a workspace too small.
    """
    cache_d = check_cache(k_cache, v_cache)
    b, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    if cache_d != d or hq % hkv or d > MAX_HEAD_DIM:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} (Hq a multiple of Hkv, "
                         f"D <= {MAX_HEAD_DIM})")
    if page_table.dim() != 2 or page_table.shape[0] != b or tuple(seq_lens.shape) != (b,):
        raise ValueError(f"page_table must be [B, max_pages] and seq_lens [B] with B={b}, got "
                         f"{tuple(page_table.shape)}, {tuple(seq_lens.shape)}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be fp32/bf16/fp16, got {q.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    out = torch.empty_like(q) if out is None else out
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} contiguous along D, got {tuple(out.shape)} "
                         f"{out.dtype}")
    if gate is not None:
        if gate.shape != q.shape or gate.dtype != q.dtype:
            raise ValueError(f"gate must be {tuple(q.shape)} {q.dtype}, got {tuple(gate.shape)} {gate.dtype}")
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    # NOTE: no gate: out stands in for its pointer, never read (HAS_GATE prunes the load)
    g, g_strides = (gate, (gate.stride(0), gate.stride(1))) if gate is not None else (out, (0, 0))
    if b == 0:
        return out
    k_cache, v_cache, kvs, kv_flags = kv_args(k_cache, v_cache, kv_scale, q)
    cfg = {**tuning.decode_config(d, hq // hkv, q.dtype), **(config or {})}
    opts = kernel_options().decode_attention
    block_dc = min(cfg["BLOCK_D"], cfg.pop("COMBINE_BLOCK_D", opts.combine_block_d))  # (the combine's, not the split's)
    cfg["NVFP4_HALVES"] = bool(cfg["NVFP4_HALVES"]) and kv_flags["KV_NVFP4"] and cfg["BLOCK_D"] >= 32  # halves: dot K >= 16
    cfg["EVEN_D"] = d == cfg["BLOCK_D"]  # no mask along D: vectorized K/V loads
    cfg["NVFP4_F16"] = bool(cfg["NVFP4_F16"]) and kv_flags["KV_NVFP4"] and q.dtype != torch.float32
    if cfg["NVFP4_F16"] and not (config or {}).get("BLOCK_N"):
        cfg["BLOCK_N"] = 64  # measured: 64 keys a step beat 32 with the fp16 tiles (92 against 107 us at 128K)
    # the halves decoded to fp16 in inline PTX: four bytes per PTX instance (whole rows, D % 64 == 0)
    cfg["NVFP4_PRMT"] = (bool(cfg.get("NVFP4_PRMT", False)) and kv_flags["KV_NVFP4"] and q.dtype != torch.float32
                         and cfg["EVEN_D"] and d % 64 == 0)
    cfg["NVFP4_ASM"] = cfg["NVFP4_PRMT"] and bool(cfg.get("NVFP4_ASM", True)) and inline_ptx(q.device)
    if cfg["NVFP4_PRMT"] and not (config or {}).get("BLOCK_N"):
        cfg["BLOCK_N"] = opts.prmt_block_n
    if cfg["NVFP4_PRMT"] and not (config or {}).get("num_stages"):
        cfg["num_stages"] = opts.prmt_stages
    if cfg["NVFP4_PRMT"] and not (config or {}).get("num_warps"):
        cfg["num_warps"] = opts.prmt_warps
    if splits is None:
        splits = tuning.decode_split_count(b, hkv, max_seq_len or page_table.shape[1] * page, q.device, cfg["NVFP4_PRMT"])
    if (cfg["NVFP4_PRMT"] and opts.prmt_maxnreg and "maxnreg" not in cfg and splits > 1
            and b * hkv * splits > 2 * sm_count(q.device)):
        cfg["maxnreg"] = opts.prmt_maxnreg
    common = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0))
    scale2 = scale * LOG2E
    if splits == 1:
        _decode_kernel[(b, hkv)](q, k_cache, v_cache, page_table, seq_lens, g, out, kvs, scale2, hq // hkv, d,
                                 *common, *g_strides, out.stride(0), out.stride(1), PAGE_SIZE=page,
                                 HAS_GATE=gate is not None, **kv_flags, **cfg, **pdl_args(q.device))
        return out
    if workspace is None:
        workspace = decode_attention_workspace(b, hq, d, splits, q.device)
    if workspace.rows < b * splits or tuple(workspace.acc.shape[1:]) != (hq, d) or workspace.acc.stride(-1) != 1 \
            or workspace.stats.stride(-1) != 1:
        raise ValueError(f"workspace {tuple(workspace.acc.shape)} is too small for B={b} x {splits} splits, "
                         f"Hq={hq}, D={d}")
    acc, st = workspace.acc, workspace.stats
    _decode_split_kernel[(b, hkv, splits)](q, k_cache, v_cache, page_table, seq_lens, acc, st, kvs, scale2,
                                           hq // hkv, d, *common, acc.stride(0), acc.stride(1), st.stride(0),
                                           st.stride(1), PAGE_SIZE=page, **kv_flags, **cfg, **pdl_args(q.device))
    combine_splits(acc, st, gate, out, splits, block_dc)
    return out


def combine_splits(acc: torch.Tensor, stats: torch.Tensor, gate: torch.Tensor | None, out: torch.Tensor, splits: int,
                   block_d: int) -> None:
    """The split-K decode's combine (`_decode_combine_kernel`, one launch): out [B, Hq, D] = the splits'
    softmax-weighted sum (times sigmoid(gate) [B, Hq, D] when given, unit stride along D), from acc
    [>= B * splits, Hq, D] and stats [>= B * splits, Hq, 2] (max, sum in log2 units), row b * splits + s,
    fp32, unit stride along D and the pair. Shared by the paged and the sparse (QSA) decode attention."""
    b, hq, d = out.shape
    # NOTE: no gate: out stands in for its pointer, never read (HAS_GATE prunes the load)
    g, g_strides = (gate, (gate.stride(0), gate.stride(1))) if gate is not None else (out, (0, 0))
    _decode_combine_kernel[(b, hq, triton.cdiv(d, block_d))](
        acc, stats, g, out, splits, d, acc.stride(0), acc.stride(1), stats.stride(0), stats.stride(1), *g_strides,
        out.stride(0), out.stride(1), CHUNK_S=COMBINE_CHUNK_S, BLOCK_D=block_d, HAS_GATE=gate is not None, num_warps=4,
        **pdl_args(out.device))
