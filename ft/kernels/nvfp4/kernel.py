"""Triton kernels for the NVFP4 linear ``y = x @ dequant(W)^T`` (details module of `ft.kernels.nvfp4`).

Weight layout: exactly as ModelOpt checkpoints store it, no load-time repack:
``packed`` uint8 [N, K/2] (element 2j in the low nibble of byte j), ``scale`` float8_e4m3fn
[N, K/16] (read here as its uint8 bits), ``scale_2`` float32 scalar applied in the epilogue.
The kernels read ``packed`` as 32-bit *words* (``packed.view(int32)`` [N, K/8]): word w of a row
holds elements 8w .. 8w+7, byte i holding elements 8w+2i (low nibble) and 8w+2i+1 (high nibble),
and two consecutive words share one block scale.

E2M1 decoding (the helpers live in `decode.py`), plain Triton (it runs in the interpreter), four bytes per 32-bit operation: a
nibble ``s e1 e0 m`` is moved into an E4M3 byte ``s 0 0 e1 e0 m 0 0``, whose value is exactly
``e2m1 * 2**-6`` (code 1, the E2M1 subnormal 0.5, lands on the E4M3 subnormal 2**-7). Done on the
whole word with shifts and masks (`lo_e4m3_word`, `hi_e4m3_word`: about one integer operation
per element instead of four when each byte is handled alone), then each byte goes through the
fp8 -> fp32 conversion (a packed hardware conversion on Hopper). The 2**6 is folded into the
epilogue, so ``dec * scale`` is the exact product ``e2m1 * scale * 2**-6`` (at most 5 significant
bits: exact in fp32, bf16 and fp16).

Two kernels:

* `_nvfp4_gemv_kernel` (M <= 2, and M <= 8 on the shapes where it wins, see `_path`): a program
  owns BLOCK_N rows; with K / 8 a power of two <= 1024 it takes the rows' whole K in one tile
  (`whole_k_tile`, decoded once for all rows of x; no loop, each x row read once), at M = 1 in two
  such tiles when K / 8 is the sum of two powers of two (Qwen3.8-Flash-Next's 2,560 and 6,144), else it walks K
  in steps of BLOCK_W words (`nvfp4_rows_dot`); per word 8 FMAs on fp32 products, then one FMA with
  the block scale; x is read in its natural order and split into the 8 element lanes of a word with
  ``tl.split``.
* `_nvfp4_dot_kernel` (larger M: 16- to 64-row tiles up to M = 64, larger tiles for prefill): tiles of
  x [BLOCK_M, BLOCK_K] times the dequantized weight tile (`dequant_tile`: byte-wise decode,
  scaled, cast to x's dtype, even/odd elements interleaved with ``tl.join``; measured faster
  inside ``tl.dot`` than the word-wise decode) with fp32 accumulation; fp32 x uses
  ``input_precision="ieee"``. The tiles up to M = 64 (bf16/fp16 x) take the halves instead
  (`Nvfp4Options.dot_halves`, `_halves_step`): x's even and odd columns against the low and high nibbles,
  decoded by byte permutes in inline PTX (1.06-1.10x on the H200 at M = 8; at M = 32 / 64 with
  narrower tiles 1.1-3.2x, session 28).

Where the time goes (SASS compiled for sm_90, triton 3.6): about 6.5 instructions per weight
element in the GEMV (1 FFMA, 1.1 f16->f32 conversions, 0.56 fp8x2->f16x2 conversions, about 3
integer ops, loads). Layout conversions through shared memory (the x lanes, a 3-D accumulator)
cost more than the decode: removing them from the loop (2-D accumulator, whole-K tile, x loaded
with the weight) took the large GEMV from 24% to 48% of the copy ceiling, while an inline-PTX
decode would add at most 1.17x (bench/gemv_decode_probe.py) and is not used.

Measured on the H200: bench/kernels_nvfp4.py, figures in bench/RESULTS.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.backend import inline_ptx, sm_count
from ft.kernels.limits import whole_k_pieces
from ft.kernels.options import kernel_options
from ft.kernels.tickets import ticket_counters
from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait
from ft.kernels.nvfp4.decode import (HALVES_SCALED_EXPONENT, e4m3_f32, dequant_tile, e2m1_halves_bf16, e2m1_halves_f16,
                                    e2m1_halves_f16_scaled)
from ft.kernels.nvfp4.f16_rows import f16_rows
from ft.kernels.nvfp4.rows import (dot_whole_k, load_whole_k, whole_k_row, whole_k_tile, x_lanes, nvfp4_rows_dot,
                                   rows_dot_whole_k)

__all__ = ["SMALL_M", "half_sums_take", "nvfp4_linear_triton"]

SMALL_M = 2
"""Rows of x up to which the GEMV kernel runs; above it the ``tl.dot`` kernel (with a 16-row
tile for M <= 16, the small-M decode case)."""
# the variants of this file's decode (the whole-K GEMV at small M, the tile's halves, the words' PTX)
# are options: `ft.kernels.options.Nvfp4Options`


def half_sums_take(x: torch.Tensor) -> bool:
    """Whether a kernel reading `x` may sum blocks in fp16 (`Nvfp4Options.half_sums`): a bf16 or fp16
    model's activations (an fp32 model keeps its exact fp32 sums)."""
    return x.dtype in (torch.bfloat16, torch.float16)


@triton.jit
def _nvfp4_gemv_kernel(
    p_x, p_w, p_s, p_s2, p_y,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, WHOLE_K: tl.constexpr = 0,
    ASM: tl.constexpr = False, PDL: tl.constexpr = False, WHOLE_K2: tl.constexpr = 0,
):
    # fp32 block sums: the fp16 ones (`Nvfp4Options.half_sums`) lost here at one x row (bench/RESULTS.md
    # session 46), so this kernel has none.
    # PDL (`ft.kernels.pdl`): the whole-K tile's weights are loaded before the wait (no kernel of
    # the step writes them), x after it; the K loop waits first
    i_n = tl.program_id(0)
    if WHOLE_K > 0:  # K / 8 = WHOLE_K words in one tile, decoded once for all M rows of x
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        s2 = tl.load(p_s2)
        if WHOLE_K2 > 0:  # M = 1, K / 8 = WHOLE_K + WHOLE_K2 (`whole_k_split`): a second tile
            # words WHOLE_K.. of each row, their scale bytes WHOLE_K / 2.., x's elements 8 WHOLE_K..
            pdl_wait(PDL)
            pdl_release(PDL)
            b_y = rows_dot_whole_k(p_w, p_s, o_n, m_n, stride_wn, stride_sn, p_x, WHOLE_K, BLOCK_N, ASM, False)
            b_y += rows_dot_whole_k(p_w + WHOLE_K, p_s + WHOLE_K // 2, o_n, m_n, stride_wn, stride_sn,
                                    p_x + 8 * WHOLE_K, WHOLE_K2, BLOCK_N, ASM, False)
            tl.store(p_y + o_n, (b_y * s2).to(p_y.dtype.element_ty), mask=m_n)
        elif BLOCK_M == 1 and not PDL:
            b_y = rows_dot_whole_k(p_w, p_s, o_n, m_n, stride_wn, stride_sn, p_x, WHOLE_K, BLOCK_N, ASM, False)
            tl.store(p_y + o_n, (b_y * s2).to(p_y.dtype.element_ty), mask=m_n)
        elif BLOCK_M == 1:  # `rows_dot_whole_k` with the weights first
            b_w, b_sb = load_whole_k(p_w, p_s, o_n, m_n, stride_wn, stride_sn, WHOLE_K)
            pdl_wait(PDL)
            pdl_release(PDL)
            x0, x1, x2, x3, x4, x5, x6, x7 = x_lanes(p_x, WHOLE_K)
            b_y = dot_whole_k(b_w, b_sb, x0, x1, x2, x3, x4, x5, x6, x7, WHOLE_K, BLOCK_N, ASM, False)
            tl.store(p_y + o_n, (b_y * s2).to(p_y.dtype.element_ty), mask=m_n)
        else:
            d0, d1, d2, d3, d4, d5, d6, d7, b_s = whole_k_tile(p_w, p_s, o_n, m_n, stride_wn, stride_sn, WHOLE_K, ASM)
            pdl_wait(PDL)
            pdl_release(PDL)
            for mi in tl.static_range(BLOCK_M):
                if mi < M:
                    b_y = whole_k_row(d0, d1, d2, d3, d4, d5, d6, d7, b_s, p_x + mi * stride_xm, WHOLE_K, BLOCK_N)
                    tl.store(p_y + mi * stride_ym + o_n, (b_y * s2).to(p_y.dtype.element_ty), mask=m_n)
        return
    pdl_wait(PDL)
    pdl_release(PDL)
    o_m = tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    b_y = nvfp4_rows_dot(p_w, p_s, o_n, m_n, stride_wn, stride_sn, p_x, o_m, m_m, stride_xm, 0, K // 8,
                         BLOCK_M, BLOCK_N, BLOCK_W)
    p_yt = p_y + o_m[:, None] * stride_ym + o_n[None, :]
    tl.store(p_yt, (b_y * tl.load(p_s2)).to(p_y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _interleaved_step(acc, p_x, p_w, p_s, o_m, m_m, o_n, m_n, stride_xm, stride_wn, stride_sn, k, K,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
                      EVEN_K: tl.constexpr):
    """One K step of `_nvfp4_dot_kernel` over the whole dequantized weight tile (elements in k order)."""
    o_k = k + tl.arange(0, BLOCK_K)
    if EVEN_K:
        m_xk = m_m[:, None]
    else:
        m_xk = m_m[:, None] & (o_k < K)[None, :]
    b_x = tl.load(p_x + o_m[:, None] * stride_xm + o_k[None, :], mask=m_xk, other=0.0)
    b_wt = dequant_tile(p_w, p_s, o_n, m_n, stride_wn, stride_sn, k // 2, K // 2, b_x.dtype, BLOCK_N, BLOCK_K, EVEN_K)
    if SWAP_AB:
        acc = tl.dot(b_wt, tl.trans(b_x), acc, input_precision=PRECISION)
    else:
        acc = tl.dot(b_x, tl.trans(b_wt), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _halves_step(acc, p_x, p_w, p_s, o_m, m_m, o_n, m_n, stride_xm, stride_wn, stride_sn, k, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, ASM: tl.constexpr, F16X: tl.constexpr = False):
    """One K step of `_nvfp4_dot_kernel`'s HALVES form: acc [BLOCK_M, BLOCK_N] fp32 plus x[:, k:k+BLOCK_K]
    times the weight rows o_n's elements there, as x's even columns against the low nibbles and its
    odd columns against the high nibbles, decoded straight to x's dtype (`e2m1_halves_bf16` /
    `e2m1_halves_f16`: exact tiles, no interleave). x (bf16 or fp16, rows 4-byte aligned, stride_xm
    even) is read as 32-bit words, each an (even, odd) pair. F16X (fp16 x: a bf16 model's rows made fp16
    by `f16_rows`): the weights decoded as E4M3 bytes, two to a conversion (`e2m1_halves_f16_scaled`, the
    values times 2**-6: the epilogue puts the power of two back)."""
    HK: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // 16
    R: tl.constexpr = o_n.shape[0]
    dt: tl.constexpr = p_x.dtype.element_ty
    o_j = k // 2 + tl.arange(0, HK)
    b_xp = tl.load(p_x.to(tl.pointer_type(tl.int32)) + (o_m * (stride_xm // 2))[:, None] + o_j[None, :],
                   mask=m_m[:, None], other=0)
    x_e = (b_xp & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
    x_o = ((b_xp >> 16) & 0xFFFF).to(tl.uint16).to(dt, bitcast=True)
    b_w = tl.load(p_w + o_n[:, None] * stride_wn + o_j[None, :], mask=m_n[:, None], other=0)
    o_g = k // 16 + tl.arange(0, G)
    b_sb = tl.load(p_s + o_n[:, None] * stride_sn + o_g[None, :], mask=m_n[:, None], other=0)
    if dt == tl.bfloat16:
        b_sc = tl.reshape(tl.broadcast_to(e4m3_f32(b_sb).to(tl.bfloat16)[:, :, None], (R, G, 8)), (R, HK))  # byte j: j // 8
        lo, hi = e2m1_halves_bf16(b_w, b_sc, ASM)
    elif F16X:
        lo, hi = e2m1_halves_f16_scaled(b_w, tl.reshape(tl.broadcast_to(b_sb[:, :, None], (R, G, 8)), (R, HK)), ASM)
    else:
        lo, hi = e2m1_halves_f16(b_w, tl.reshape(tl.broadcast_to(b_sb[:, :, None], (R, G, 8)), (R, HK)), ASM)
    acc = tl.dot(x_e, tl.trans(lo), acc, input_precision=PRECISION)
    return tl.dot(x_o, tl.trans(hi), acc, input_precision=PRECISION)


_HALVES_SCALED_FACTOR = tl.constexpr(2.0 ** HALVES_SCALED_EXPONENT)


@triton.jit
def _scaled_out(acc, p_s2, p_xs, o_m, m_m, F16X: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] times the global scale; with F16X also times 2**HALVES_SCALED_EXPONENT (the
    scaled decode's) and each row's factor p_xs[o_m] (`f16_rows`'): powers of two, exact."""
    if F16X:
        b_xs = tl.load(p_xs + o_m, mask=m_m, other=0.0)
        return acc * (tl.load(p_s2) * _HALVES_SCALED_FACTOR) * b_xs[:, None]
    return acc * tl.load(p_s2)


@triton.jit
def _split_k_ticket(acc, p_part, p_count, p_s2, p_y, o_m, o_n, m_m, m_n, i_tile, M, N, stride_ym,
                    SPLIT_K: tl.constexpr, p_xs=None, F16X: tl.constexpr = False):
    """The end of a split-K program (`_nvfp4_dot_kernel`, SPLIT_K > 1): its fp32 partial acc
    [BLOCK_M, BLOCK_N] (unscaled) goes to p_part[split, m, n] ([SPLIT_K, M, N] fp32); then a ticket on
    the tile's counter p_count[i_tile] (int32, zero before the launch); the tile's last program sums the
    SPLIT_K partials in split order (the same sum whichever program comes last: deterministic), scales
    (`_scaled_out`), stores y and sets the counter back to zero for the next launch or graph replay."""
    i_s = tl.program_id(1)
    o_mn = o_m[:, None] * N + o_n[None, :]
    m_mn = m_m[:, None] & m_n[None, :]
    tl.store(p_part + i_s * M * N + o_mn, acc, mask=m_mn)
    tl.debug_barrier()  # every thread's stores of the program before its ticket
    done = tl.atomic_add(p_count + i_tile, 1, sem="acq_rel", scope="gpu")
    if done == SPLIT_K - 1:
        total = tl.load(p_part + o_mn, mask=m_mn, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLIT_K):
            total += tl.load(p_part + s * M * N + o_mn, mask=m_mn, other=0.0, cache_modifier=".cg")
        b_y = _scaled_out(total, p_s2, p_xs, o_m, m_m, F16X)
        tl.store(p_y + o_m[:, None] * stride_ym + o_n[None, :], b_y.to(p_y.dtype.element_ty), mask=m_mn)
        tl.atomic_xchg(p_count + i_tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _nvfp4_dot_kernel(
    p_x, p_w, p_s, p_s2, p_y,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    p_part, p_count, K_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, SWAP_AB: tl.constexpr = False, EVEN_K: tl.constexpr = False,
    HALVES: tl.constexpr = False, ASM: tl.constexpr = False, PDL: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, p_xs=None, F16X: tl.constexpr = False,
):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: before any load; the K loop streams weights and x together)
    pdl_release(PDL)
    # EVEN_K: K % BLOCK_K == 0, no mask along K (the loads vectorize; `dequant_tile`'s EVEN)
    # HALVES (with EVEN_K, bf16/fp16 x whose rows start on 4-byte boundaries, not SWAP_AB): `_halves_step`
    # SPLIT_K > 1 (grid axis 1): program (tile, s) sums K in [s * K_SPLIT, (s + 1) * K_SPLIT) (K_SPLIT a
    # multiple of BLOCK_K) and `_split_k_ticket` ends it; p_part / p_count unused at 1
    # F16X (with HALVES): x is fp16 rows scaled by powers of two whose factors back are p_xs [M] (`f16_rows`)
    i_pid = tl.program_id(0)
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share the weight tiles they read while those sit in L2
    i_group = i_pid // (GROUP_M * n_n)
    first_m = i_group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    i_m = first_m + (i_pid % (GROUP_M * n_n)) % size_m
    i_n = (i_pid % (GROUP_M * n_n)) // size_m

    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < M
    m_n = o_n < N
    # SWAP_AB: y^T = W x^T, the weight tile as the MMA's left operand (from registers on Hopper,
    # no shared-memory round trip for the dequantized tile; x^T may be as narrow as 16 columns).
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = K
    if SPLIT_K > 1:  # this split's K as a K of its own: the pointers moved to its start, the loop from 0
        k_lo = tl.multiple_of(tl.program_id(1) * K_SPLIT, BLOCK_K)  # (said so, the loads stay vectorized)
        k_len = tl.minimum(K - k_lo, K_SPLIT)
        p_x += k_lo
        p_w += tl.multiple_of(k_lo // 2, BLOCK_K // 2)
        p_s += tl.multiple_of(k_lo // 16, BLOCK_K // 16)
    for k in range(0, k_len, BLOCK_K):
        if HALVES:
            acc = _halves_step(acc, p_x, p_w, p_s, o_m, m_m, o_n, m_n, stride_xm, stride_wn, stride_sn, k, BLOCK_K,
                               PRECISION, ASM, F16X)
        else:
            acc = _interleaved_step(acc, p_x, p_w, p_s, o_m, m_m, o_n, m_n, stride_xm, stride_wn, stride_sn, k,
                                    k_len, BLOCK_N, BLOCK_K, PRECISION, SWAP_AB, EVEN_K)
    if SWAP_AB:
        acc = tl.trans(acc)
    if SPLIT_K > 1:
        _split_k_ticket(acc, p_part, p_count, p_s2, p_y, o_m, o_n, m_m, m_n, i_pid, M, N, stride_ym, SPLIT_K,
                        p_xs, F16X)
    else:
        b_y = _scaled_out(acc, p_s2, p_xs, o_m, m_m, F16X)
        p_yt = p_y + o_m[:, None] * stride_ym + o_n[None, :]
        tl.store(p_yt, b_y.to(p_y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _path(m: int, n: int, k: int) -> str:
    # H200 (bench/RESULTS.md): the GEMV kernel up to M = 2; at M = 3..8 the whole-K GEMV where it
    # beats the 16-row tl.dot tile: N <= 2048 with K / 8 = 256 (expert gate_up 1024x2048 at M = 8:
    # 6.7 against 7.6 us for the tile's halves form). Session 15: out_proj / o_proj (2048x4096)
    # moved to the tile, whose halves take 12.9 us against the GEMV's 15.3 (before the halves the
    # tile took 19.2, then 14.7). tl.dot elsewhere.
    if m <= SMALL_M:
        return "gemv"
    return "gemv" if kernel_options().nvfp4.small_m_whole_k and m <= 8 and n <= 2048 and whole_k_words(k) == 256 else "dot"


def whole_k_words(k: int) -> int:
    """K / 8 when a row's words fit one tile of the whole-K GEMV (a power of two <= 1024), else 0."""
    kw = k // 8
    return kw if 0 < kw <= 1024 and kw & (kw - 1) == 0 else 0


def whole_k_split(m: int, k: int) -> tuple[int, int]:
    """The whole-K GEMV's tiles (words of the first, of the second or 0) for a config that asks for the
    whole K: one tile, or at M = 1 two when K / 8 is no power of two but the sum of two (`whole_k_pieces`)."""
    if whole_k_words(k) or m > 1:
        return whole_k_words(k), 0
    return whole_k_pieces(k)


def _gemv_config(m: int, n: int, k: int) -> dict:
    # H200 sweeps (bench/kernels_nvfp4.py --sweep, bench/RESULTS.md). M = 1: the whole K in one
    # tile (x read and split once) beat every K loop, 4-8 rows per program (<= 4096 words);
    # otherwise 64-word steps with rows for ~384+ programs. M = 2: 8 rows x 64 words.
    block_m = triton.next_power_of_2(max(m, 1))
    kw = whole_k_words(k)
    if m > 2 and kw:  # M = 3..8 (see `_path`): the whole-K tile decoded once for all rows of x
        return {"BLOCK_M": block_m, "BLOCK_N": 4, "BLOCK_W": 2, "WHOLE_K": True, "num_warps": 4}
    if m > 1:
        return {"BLOCK_M": block_m, "BLOCK_N": 8, "BLOCK_W": max(2, min(64, triton.next_power_of_2(k // 8))), "num_warps": 4}
    # K / 8 = 2^a + 2^b: two whole-K tiles at M = 1. Against the K loop (session 40, H200, Flash-Next's
    # 48-layer step at batch 1, bench/decode.py --gpu-time): the GEMV 248 us a step less, 4.83 -> 4.59 ms
    # busy; alone (session 39, H100): 16384x2560 14.84 -> 13.64 us, 13312x2560 14.43 -> 11.80, 2560x6144 9.93 -> 6.95
    if not kw:
        kw = sum(whole_k_pieces(k))
    if kw:
        block_n = 8 if kw <= 64 else min(8 if n >= 12288 else 4, 1 << (max(1, 4096 // kw).bit_length() - 1))
        return {"BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_W": 2, "WHOLE_K": True, "num_warps": 4}
    block_n = max(4, min(32, 1 << max(0, (n // 384).bit_length() - 1)))
    if block_n == 4 and k // 8 < 128:
        block_n = 8
    block_w = max(2, min(128 if block_n == 4 else 64, triton.next_power_of_2(k // 8)))
    return {"BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_W": block_w, "num_warps": 4}


SMALL_M_WAVE_PROGRAMS_PER_SM = 3
"""Programs of `_dot_config`'s 16-row tile in 4 warps (~140 registers a thread) that fit an SM at once. A grid of
more than this many per SM runs a partial second wave: there the tile goes in 2 warps (twice the programs an SM;
`Nvfp4Options.dot_small_m_past_wave_warps`).
H100 (session 48, 16 x 32 x 256, bench/kernels_nvfp4.py shapes at M = 8 / 16): Qwen3.8-Flash-Next's in_proj_qkvz
16,384 x 2,560 (512 programs) 23.81 -> 22.06 / 23.11 -> 21.72 us, its attention projection 13,312 x 2,560 (416)
23.71 -> 21.43 / 22.28 -> 20.90; one wave or less lost in 2 warps: the 80B's in_proj_qkvz 12,288 x 2,048 (384)
15.60 -> 17.72, out_proj 2,560 x 6,144 (320 with K split) 13.85 -> 15.55."""

MID_M_MIN_PROGRAMS = 128
"""A `_dot_config` tile grid of fewer programs than this (the H200 has 132 SMs) is thin: at 16 < M <= 64 the tile
gives way to a narrower one, or with K >= `SPLIT_K_MIN_K` splits K (`Nvfp4Options.dot_split_k_few_tiles`); at
M <= 16 (the 16 x 32 tile, no narrower) it splits K from that K (`Nvfp4Options.dot_split_k_small_m`)."""
SPLIT_K_MIN_K = 4096
"""K from which a thin tile grid splits K (instead of narrowing the tile at 16 < M <= 64): the shapes where the
split was measured (out_proj / o_proj, 2,048 x 4,096 in session 44, 2,560 x 6,144 in session 45)."""


def _dot_config(m: int, n: int, k: int) -> dict:
    # H200: at M = 8, 16x32x256 was best or within 3% on every decode shape (the swapped-operand
    # form was slower there); at M = 4096 on 8192x2048, 256x128x64 with 8 warps and the weight as
    # the MMA's left operand (SWAP_AB) was the best of ten tiles (0.42 ms against 0.50 unswapped).
    # Session 28, M = 32 / 64 (bench/kernels_nvfp4.py --sweep --decode-m 32,64, eight tiles with the halves):
    # 32 x 64 x 128 at M <= 32 and 64 x 32 x 256 up to 64 were best on in_proj_qkvz and attn_q (21.5 / 13.5 us
    # at M = 32 against 27.3 / 21.7 for the 64 x 64 x 128 tile without the halves that this replaced); where
    # those launch fewer programs than the GPU has SMs (out_proj, 2,048 x 4,096: 32 programs) the narrower
    # 16 x 32 x 256 / 64 x 16 x 256 won (12.4 against 40.2 us at M = 32, 17.1 against 41.2 at 64).
    if m <= 16:
        split = 1  # (Nvfp4Options.dot_split_k_small_m: K split where the tile's grid is thin and K long)
        if triton.cdiv(n, 32) < MID_M_MIN_PROGRAMS and k >= SPLIT_K_MIN_K:
            split = kernel_options().nvfp4.dot_split_k_small_m
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4, "num_stages": 3,
                "SPLIT_K": split}
    # Session 44 (the sweep with K split over programs): out_proj 2,048 x 4,096 at M = 32 12.46 us (the narrow
    # tile) against 9.84 with the wide tile's K over 4 programs, at M = 64 17.23 against 11.50; where the wide
    # tile fills the GPU, splitting lost or tied (attn_q 8,192 x 2,048: 13.45 -> 13.74 / 14.83 at M = 32; in_proj_qkvz
    # at M = 64: 24.21 -> 28.96 / 36.52) but for in_proj_qkvz at M = 32 (21.45 -> 18.26 in 2), left alone here.
    if m <= 64:
        block_m, block_n, block_k = (32, 64, 128) if m <= 32 else (64, 32, 256)
        split = 1
        if triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < MID_M_MIN_PROGRAMS:
            split = kernel_options().nvfp4.dot_split_k_few_tiles if k >= SPLIT_K_MIN_K else 1
            if split <= 1:
                block_m, block_n, block_k = (16, 32, 256) if m <= 32 else (64, 16, 256)
        return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 1, "num_warps": 4,
                "num_stages": 3, "SPLIT_K": max(split, kernel_options().nvfp4.dot_split_k)}
    return {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "SWAP_AB": True}


def dot_launch_config(x: torch.Tensor, packed: torch.Tensor, config: dict | None = None) -> dict:
    """`_nvfp4_dot_kernel`'s constexprs and launch options for x [M, K] and packed [N, K/2]: `config`
    (whole, benchmarks and tests) or `_dot_config`'s, with what the tensors allow: EVEN_K, HALVES (`Nvfp4Options.dot_halves` at M <= 64, fp16/bf16 x, whole 64-column tiles, x rows on 4-byte
    boundaries), ASM (the halves' inline PTX, off in the interpreter or by config) and SPLIT_K (the
    config's, 1 if it names none; made a count whose splits all hold K steps); without `config`, the 16-row
    tile's warps past one wave (`SMALL_M_WAVE_PROGRAMS_PER_SM`, by the device's SM count)."""
    (m, k), n = x.shape, packed.shape[0]
    cfg = dict(config or _dot_config(m, n, k))
    if config is None and m <= 16 and cfg.get("SPLIT_K", 1) == 1 and \
            triton.cdiv(n, cfg["BLOCK_N"]) > SMALL_M_WAVE_PROGRAMS_PER_SM * sm_count(x.device) > 0:
        cfg["num_warps"] = kernel_options().nvfp4.dot_small_m_past_wave_warps  # (`SMALL_M_WAVE_PROGRAMS_PER_SM`)
    want = cfg.get("SPLIT_K", 1)  # (`_dot_config`'s, from the options at M <= 64)
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    per_split = triton.cdiv(steps, max(1, min(want, steps)))
    cfg["SPLIT_K"] = triton.cdiv(steps, per_split)  # no empty split: each holds per_split steps but the last
    cfg["EVEN_K"] = k % cfg["BLOCK_K"] == 0
    cfg["HALVES"] = bool(cfg.get("HALVES", kernel_options().nvfp4.dot_halves and m <= 64)) and cfg["EVEN_K"] and x.dtype != torch.float32 \
        and x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0 and cfg["BLOCK_K"] % 64 == 0 and not cfg.get("SWAP_AB")
    cfg["ASM"] = cfg["HALVES"] and bool(cfg.get("ASM", True)) and inline_ptx(x.device)
    return cfg


def f16_rows_take(x: torch.Tensor, cfg: dict) -> bool:
    """Whether a tile launch (`dot_launch_config`'s cfg) takes x as fp16 rows (`f16_rows`): a bf16 x on the
    halves form of at most `Nvfp4Options.dot_f16_x_max_m` rows (None, no model's choice in force: none)."""
    return bool(cfg["HALVES"] and x.dtype == torch.bfloat16 and x.shape[0] <= (kernel_options().nvfp4.dot_f16_x_max_m or 0))


def as_words(packed: torch.Tensor) -> torch.Tensor:
    """uint8 packed weights [..., K/2] -> the same bytes as int32 words [..., K/8] (a view when aligned)."""
    if packed.stride(-1) != 1 or packed.storage_offset() % 4 or any(s % 4 for s in packed.stride()[:-1]):
        packed = packed.contiguous()
    return packed.view(torch.int32)


def nvfp4_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor | float,
    *,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(W).T on Triton: x [M, K] fp32/bf16/fp16, W NVFP4 [N, K] -> y [M, N] in x's dtype.

    Args:
        packed: uint8 [N, K/2]; scale: float8_e4m3fn [N, K/16]; scale_2: scalar (tensor or float).
        out: optional [M, N] output in x's dtype (written entirely).
        config: block sizes and launch options overriding the heuristics (benchmarks).
        path: "gemv" or "dot" to force a kernel; default: gemv for M <= SMALL_M, dot above.
    Raises:
        ValueError: on shapes or dtypes the kernels do not take.
    """
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be [M, K] fp32/bf16/fp16, got {x.dtype} {tuple(x.shape)}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    m, k = x.shape
    n = packed.shape[0]
    if k % 16 or packed.shape[1] * 2 != k or tuple(scale.shape) != (n, k // 16):
        raise ValueError(f"shapes do not match: x {tuple(x.shape)}, packed {tuple(packed.shape)}, scale {tuple(scale.shape)}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scale must be float8_e4m3fn, got {scale.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    packed = packed if packed.stride(-1) == 1 else packed.contiguous()
    scale_u8 = (scale if scale.stride(-1) == 1 else scale.contiguous()).view(torch.uint8)
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=x.device).reshape(1)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return y
    path = path or _path(m, n, k)
    if path == "gemv":
        cfg = dict(config or _gemv_config(m, n, k))
        if cfg["BLOCK_M"] < m:
            raise ValueError(f"BLOCK_M {cfg['BLOCK_M']} < M {m}")
        cfg["WHOLE_K"], cfg["WHOLE_K2"] = whole_k_split(m, k) if cfg.pop("WHOLE_K", False) else (0, 0)
        if cfg["WHOLE_K"] == 0 and cfg["BLOCK_W"] < 2:
            raise ValueError(f"a whole-K config for K {k} at M {m}, which neither one nor two whole-K tiles take")
        cfg["ASM"] = bool(cfg.get("ASM", kernel_options().nvfp4.lanes_ptx)) and cfg["WHOLE_K"] > 0 and inline_ptx(x.device)
        words = as_words(packed)
        _nvfp4_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
            x, words, scale_u8, s2, y, m, n, k, x.stride(0), words.stride(0), scale_u8.stride(0), y.stride(0), **cfg,
            **pdl_args(x.device))
    elif path == "dot":
        cfg = dot_launch_config(x, packed, config)
        tiles, splits = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"]
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        part, count, k_split = y, s2, k  # (unread at SPLIT_K 1)
        if splits > 1:
            part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
            count = ticket_counters(x.device, tiles)
            k_split = triton.cdiv(triton.cdiv(k, cfg["BLOCK_K"]), splits) * cfg["BLOCK_K"]
        xs = s2  # (unread without F16X)
        if f16_rows_take(x, cfg):
            x, xs = f16_rows(x)  # (y keeps the caller's dtype)
            cfg["F16X"] = True
        _nvfp4_dot_kernel[(tiles, splits)](
            x, packed, scale_u8, s2, y, m, n, k, x.stride(0), packed.stride(0), scale_u8.stride(0), y.stride(0),
            part, count, k_split, PRECISION=precision, p_xs=xs, **cfg, **pdl_args(x.device))
    else:
        raise ValueError(f"path must be 'gemv' or 'dot', got {path!r}")
    return y
