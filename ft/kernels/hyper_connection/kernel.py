"""The HyperConnection kernels in Triton (`reference.py` is the contract of each):

- `_grouped_norm_kernel`, grid (T, C): stream k of row t normalised (fp32, rounded as the Qwen3-Next
  norm kernel rounds), times 1 + its weight row.
- `_mix_kernel`, grid (T, D / BLOCK_D): u = mean over the C streams of sigmoid(g_k) * n_k.
- `_write_kernel`, grid (T, C): a_k = 2 sigmoid(logit_k) (the logits inject N / C come from the read's
  GEMM), x_k + a_k y, and optionally the next read's norm of that stream: the write and the next
  read's norm in one pass (what was ~8 torch launches). (A first form computed the C inject dots
  itself, one program a row: 16 us a call on the H200 at T = 1, 1.5 ms of an 8 ms step.)

A read of at most `HyperConnectionOptions.fused_read_max_tokens` tokens after its norm (`hc_read_triton`,
in place of two cuBLAS GEMMs, a split-K reduce, a SiLU and `_mix_kernel`) takes one of two forms:
- `_read_down_kernel`, grid (R / ROWS, W / CHUNK): a short read's first projection in fp32 partial
  sums, z_part[s, t, r] = sum over the chunk s of the streams' columns of N[t, :] mix_in[r, :]; each
  program loads its [ROWS, CHUNK] weight tile once and dots it with every token's chunk of N.
- `_read_up_mix_streams_kernel`, grid (D / BLOCK_D,): the rest of the read in one pass: z = (sum over s
  of z_part) / C rounded to the weights' dtype, SiLU, g_k = up_k silu(z) for the program's columns of
  every stream k (their up rows one tile), and u = mean over k of sigmoid(g_k) n_k; the first program
  also writes the write's gate logits (z's last C rows).
  These two are the read form "fma" (`HyperConnectionOptions.fma_read_max_tokens`: one token).
- The read form "dot" (longer reads) takes every token at once on tensor cores (tokens padded to 16 rows):
  `_read_down_dot_kernel`, grid (R / ROWS, W / CHUNK), partial sums as above by `tl.dot` over K steps;
  `_read_reduce_kernel`, grid (T,), the partials' sum, z rounded, its SiLU (the up projection's input
  a [T, rank]) and the gate logits; `_read_up_mix_dot_streams_kernel`, grid (D / BLOCK_D,), g of every
  stream k = a up_k^T by one `tl.dot` a rank step, then the gated mean.
(The up kernels' first forms ran one load-and-reduce chain per stream, C dependent rounds of loads: at
4 streams of 2,560, rank 320 on the H100, 14.6 us a read at 1 token and 18.3-22.0 us at 8-64 against
12.5 and 13.7-15.2 us, session 38; commit d6caade holds them.)
(A first Triton form, 18ab3ee: partial sums over K splits, then up and the mix in tiles of 64 rows of D,
40 programs, measured 20-88 us a read against cuBLAS's 17-22, bench/RESULTS.md, 2026-12-03.)

Each rounds where the reference's torch ops round (to the activation or weight dtype between steps),
so that bf16 results stay the reference's but for the order of fp32 sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.norm.kernel import rms_rstd
from ft.kernels.options import kernel_options
from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["grouped_rms_norm_triton", "hc_mix_triton", "hc_read_triton", "hc_write_read_triton", "hc_write_triton"]


@triton.jit
def _norm_stream(b_x, p_w, o_d, m_d, D, eps):
    """A stream's values b_x (fp32 [BLOCK_D], masked lanes 0) normalised times 1 + w (p_w its weight row)."""
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    return (b_x * rms_rstd(b_x, D, eps)) * (1.0 + b_w)


@triton.jit(do_not_specialize=["D"])
def _grouped_norm_kernel(p_x, p_w, p_y, D, eps, stride_xt, stride_yt, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_x + i_t * stride_xt + i_k * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = _norm_stream(b_x, p_w + i_k * D, o_d, m_d, D, eps)
    tl.store(p_y + i_t * stride_yt + i_k * D + o_d, b_y.to(p_y.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["D"])
def _mix_kernel(p_g, p_n, p_u, D, stride_gt, stride_nt, stride_ut, C: tl.constexpr, BLOCK_D: tl.constexpr,
                PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(C):
        b_g = tl.load(p_g + i_t * stride_gt + k * D + o_d, mask=m_d, other=0.0)
        b_n = tl.load(p_n + i_t * stride_nt + k * D + o_d, mask=m_d, other=0.0)
        b_s = tl.sigmoid(b_g.to(tl.float32)).to(p_g.dtype.element_ty)  # sigmoid in g's dtype
        acc += (b_s.to(tl.float32) * b_n.to(tl.float32)).to(p_u.dtype.element_ty).to(tl.float32)
    tl.store(p_u + i_t * stride_ut + o_d, (acc / C).to(p_u.dtype.element_ty), mask=m_d)


@triton.jit
def _write_kernel(p_x, p_y, p_a, p_wn, p_out, p_nn, eps, stride_xt, stride_yt, stride_at, stride_ot, stride_nnt,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, NEXT_NORM: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    # D a constexpr (a model's stream width): the mask past D then keeps the loads 16 bytes wide
    i_t, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    # a_k = 2 sigmoid(logit), in the logits' dtype (as the reference's torch ops round), then x's
    logit = tl.load(p_a + i_t * stride_at + i_k).to(tl.float32)
    gate = (2.0 * tl.sigmoid(logit).to(p_a.dtype.element_ty).to(tl.float32)).to(p_a.dtype.element_ty)
    gate = gate.to(p_out.dtype.element_ty).to(tl.float32)
    b_y = tl.load(p_y + i_t * stride_yt + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_x = tl.load(p_x + i_t * stride_xt + i_k * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    add = (gate * b_y).to(p_out.dtype.element_ty).to(tl.float32)
    b_o = (b_x + add).to(p_out.dtype.element_ty)
    tl.store(p_out + i_t * stride_ot + i_k * D + o_d, b_o, mask=m_d)
    if NEXT_NORM:
        d_value = tl.full((), D, tl.int32)  # (the norm divides by D as a value, not a constexpr)
        b_nn = _norm_stream(tl.where(m_d, b_o.to(tl.float32), 0.0), p_wn + i_k * D, o_d, m_d, d_value, eps)
        tl.store(p_nn + i_t * stride_nnt + i_k * D + o_d, b_nn.to(p_nn.dtype.element_ty), mask=m_d)


@triton.jit
def _read_down_kernel(p_n, p_w, p_zp, T, R, W, stride_nt, stride_wr, stride_zp, ROWS: tl.constexpr,
                      CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_r, i_s = tl.program_id(0), tl.program_id(1)
    o_r = i_r * ROWS + tl.arange(0, ROWS)
    m_r = o_r < R
    o_w = i_s * CHUNK + tl.arange(0, CHUNK)
    m_w = o_w < W
    b_w = tl.load(p_w + o_r[:, None].to(tl.int64) * stride_wr + o_w[None, :], mask=m_r[:, None] & m_w[None, :],
                  other=0.0).to(tl.float32)
    for t in range(T):
        # N in the weights' dtype, as the reference casts it before its GEMM
        b_n = tl.load(p_n + t * stride_nt + o_w, mask=m_w, other=0.0).to(p_w.dtype.element_ty).to(tl.float32)
        tl.store(p_zp + (i_s * T + t) * stride_zp + o_r, tl.sum(b_w * b_n[None, :], axis=1), mask=m_r)


@triton.jit
def _write_down_deferred_kernel(p_x, p_y, p_a, p_wn, p_w, p_out, p_zp, p_ss, T, R, stride_xt, stride_yt, stride_at,
                                stride_ot, stride_wr, stride_zp, C: tl.constexpr, D: tl.constexpr, SK: tl.constexpr,
                                SPAN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """A write and the next read's first projection with the norm's 1 / rms left to the up kernel (grid
    (R / ROWS, C * SK)): program (i_r, i_s) owns SPAN columns of one stream k = i_s // SK (chunks never
    straddle streams), computes x' = x_k + a_k y there (rounded as `_write_kernel`), and stores
    z_part[i_s, t, r] = sum over its columns of mix_in[r] x' (1 + w): the dot of the stream's norm before
    its 1 / rms, which is the same for every column of the chunk. The programs of the first row tile store
    x' and the chunk's sum of squares ss[i_s, t]. So no program reads another stream (the form before, which
    recomputed every stream's write in each program for its norm, ~25 KB of L2 reads each, lost:
    `HyperConnectionOptions`). The reference's N is rounded to the activations' dtype before its GEMM; here
    the dot takes it unrounded (a few bf16 ulps apart in z, inside the read's own error)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_r, i_s = tl.program_id(0), tl.program_id(1)
    k = i_s // SK
    o_r = i_r * ROWS + tl.arange(0, ROWS)
    m_r = o_r < R
    o_b = tl.arange(0, BLOCK)
    o_d = (i_s % SK) * SPAN + o_b
    m_d = (o_b < SPAN) & (o_d < D)
    o_w = k * D + o_d
    x_dtype = p_out.dtype.element_ty
    a_dtype = p_a.dtype.element_ty
    b_w = tl.load(p_w + o_r[:, None].to(tl.int64) * stride_wr + o_w[None, :], mask=m_r[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)
    b_wn = 1.0 + tl.load(p_wn + o_w, mask=m_d, other=0.0).to(tl.float32)
    for t in range(T):
        # a_k = 2 sigmoid(logit_k) rounded as `_write_kernel` rounds it
        b_lg = tl.load(p_a + t * stride_at + k).to(tl.float32)
        b_gate = (2.0 * tl.sigmoid(b_lg).to(a_dtype).to(tl.float32)).to(a_dtype).to(x_dtype).to(tl.float32)
        b_x = tl.load(p_x + t * stride_xt + o_w, mask=m_d, other=0.0).to(tl.float32)
        b_y = tl.load(p_y + t * stride_yt + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_o = (b_x + (b_gate * b_y).to(x_dtype).to(tl.float32)).to(x_dtype)
        b_of = tl.where(m_d, b_o.to(tl.float32), 0.0)
        if i_r == 0:
            tl.store(p_out + t * stride_ot + o_w, b_o, mask=m_d)
            tl.store(p_ss + i_s * T + t, tl.sum(b_of * b_of, axis=0))
        tl.store(p_zp + (i_s * T + t) * stride_zp + o_r, tl.sum(b_w * (b_of * b_wn)[None, :], axis=1), mask=m_r)


@triton.jit
def _partials_sum(p_zp, t, T, S, R, o_r, m_r):
    """z_part[:, t, o_r] summed over the S chunks in order (fp32; masked lanes 0): a read's down projection."""
    b_z = tl.zeros(o_r.shape, dtype=tl.float32)
    for s in range(S):
        b_z += tl.load(p_zp + (s * T + t) * R + o_r, mask=m_r, other=0.0)
    return b_z


@triton.jit
def _read_down_dot_kernel(p_n, p_w, p_zp, T, R, W, stride_nt, stride_wr, BLOCK_T: tl.constexpr, ROWS: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                          PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_r, i_s = tl.program_id(0), tl.program_id(1)
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_r = i_r * ROWS + tl.arange(0, ROWS)
    m_r = o_r < R
    acc = tl.zeros((BLOCK_T, ROWS), dtype=tl.float32)
    for k in range(0, CHUNK, BLOCK_K):
        o_w = i_s * CHUNK + k + tl.arange(0, BLOCK_K)
        m_w = o_w < W
        # N in the weights' dtype, as the reference casts it before its GEMM
        b_n = tl.load(p_n + o_t[:, None] * stride_nt + o_w[None, :], mask=m_t[:, None] & m_w[None, :],
                      other=0.0).to(p_w.dtype.element_ty)
        b_w = tl.load(p_w + o_r[:, None].to(tl.int64) * stride_wr + o_w[None, :], mask=m_r[:, None] & m_w[None, :],
                      other=0.0)
        acc = tl.dot(b_n, tl.trans(b_w), acc, input_precision=PRECISION)
    tl.store(p_zp + (i_s * T + o_t[:, None]) * R + o_r[None, :], acc, mask=m_t[:, None] & m_r[None, :])


@triton.jit
def _read_reduce_kernel(p_zp, p_a, p_gl, T, S, R, RANK, inv_c, stride_at, stride_glt, BLOCK_R: tl.constexpr,
                        GATES: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    t = tl.program_id(0)
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < R
    # z = N mix_in^T / C in the weights' dtype (the GEMM's one rounding), SiLU rounded there too
    b_z = (_partials_sum(p_zp, t, T, S, R, o_r, m_r) * inv_c).to(p_a.dtype.element_ty).to(tl.float32)
    tl.store(p_a + t * stride_at + o_r, (b_z * tl.sigmoid(b_z)).to(p_a.dtype.element_ty), mask=o_r < RANK)
    if GATES:
        tl.store(p_gl + t * stride_glt + (o_r - RANK), b_z.to(p_gl.dtype.element_ty), mask=m_r & (o_r >= RANK))


@triton.jit
def _read_up_mix_streams_kernel(p_zp, p_up, p_n, p_u, p_gl, T, S, stride_zp, D, inv_c, stride_upr, stride_nt, stride_ut,
                                stride_glt, p_wn, p_ss, eps, RANK: tl.constexpr, C: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                                GATES: tl.constexpr, SK: tl.constexpr = 0, R2: tl.constexpr = 0,
                                PDL: tl.constexpr = False):
    """The form "fma"'s second launch, its loads issued at once: the up rows of every stream's columns
    of the program as one [C * BLOCK_D, BLOCK_R] tile (row j: stream j // BLOCK_D) and a token's partial
    sums as one [BLOCK_S, BLOCK_R] tile, all issued before their first use (RANK a constexpr, so the
    rank mask does not keep the loads from 16-byte vectors).
    SK > 0 (after `_write_down_deferred_kernel`, SK chunks a stream): p_n holds the written streams x',
    not their norm; each stream's 1 / rms comes from the chunks' sums of squares p_ss [S, T], scales its
    chunks' partials (partial s: stream s // SK) and normalises x' (times 1 + p_wn) for the mix.
    R2 > 0 (a rank that is no power of two, `_read_up_fma`): the rank in two tiles, BLOCK_R (a power of two <=
    RANK, no rank mask) then R2 columns from BLOCK_R (masked past RANK only where BLOCK_R + R2 > RANK),
    instead of one tile of next_power_of_2(RANK) columns (rank 320: 512, 37.5% of it masked lanes that
    hold registers; the one tile lost: `HyperConnectionOptions`)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_d = tl.program_id(0)
    o_j = tl.arange(0, C * BLOCK_D)
    o_k = o_j // BLOCK_D
    o_d = i_d * BLOCK_D + o_j % BLOCK_D
    m_d = o_d < D
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < RANK
    if R2 > 0:  # the first piece lies inside the rank: no mask along it
        m_r = tl.full((BLOCK_R,), True, tl.int1)
        o_r2 = BLOCK_R + tl.arange(0, R2)
        m_r2 = o_r2 < RANK
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < S
    w_dtype = p_up.dtype.element_ty
    for t in range(T):
        # every load of the token before any use: one round trip (the up tile again from L2 past the first token)
        b_up = tl.load(p_up + (o_k * D + o_d)[:, None].to(tl.int64) * stride_upr + o_r[None, :],
                       mask=m_d[:, None] & m_r[None, :], other=0.0)
        b_zp = tl.load(p_zp + (o_s[:, None] * T + t) * stride_zp + o_r[None, :], mask=m_s[:, None] & m_r[None, :],
                       other=0.0)
        b_n = tl.load(p_n + t * stride_nt + o_k * D + o_d, mask=m_d, other=0.0)
        if R2 > 0:
            b_up2 = tl.load(p_up + (o_k * D + o_d)[:, None].to(tl.int64) * stride_upr + o_r2[None, :],
                            mask=m_d[:, None] & m_r2[None, :], other=0.0)
            b_zp2 = tl.load(p_zp + (o_s[:, None] * T + t) * stride_zp + o_r2[None, :],
                            mask=m_s[:, None] & m_r2[None, :], other=0.0)
        if SK > 0:  # each stream's 1 / rms from its chunks' sums of squares, as `rms_rstd` rounds it
            b_ss = tl.load(p_ss + o_s * T + t, mask=m_s, other=0.0)
            # partial s's stream's sum: its SK chunks' (partials s' of the same stream)
            same = (o_s // SK)[:, None] == (o_s // SK)[None, :]
            b_sss = tl.sum(tl.where(same, b_ss[None, :], 0.0), axis=1)
            rstd_s = tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(b_sss, D.to(tl.float32)) + eps))
            b_zp = b_zp * rstd_s[:, None]
            if R2 > 0:
                b_zp2 = b_zp2 * rstd_s[:, None]
            # each row's stream's 1 / rms (row j: stream j // BLOCK_D = partial s of chunk 0 of that stream)
            rstd_j = tl.sum(tl.where(o_k[:, None] * SK == o_s[None, :], rstd_s[None, :], 0.0), axis=1)
            b_wn = tl.load(p_wn + o_k * D + o_d, mask=m_d, other=0.0).to(tl.float32)
            b_n = ((b_n.to(tl.float32) * rstd_j) * (1.0 + b_wn)).to(p_n.dtype.element_ty)
        # z = N mix_in^T / C in the weights' dtype (the GEMM's one rounding), SiLU rounded there too
        b_z = (tl.sum(b_zp, axis=0) * inv_c).to(w_dtype).to(tl.float32)
        b_a = (b_z * tl.sigmoid(b_z)).to(w_dtype).to(tl.float32)
        b_g = tl.sum(b_up.to(tl.float32) * b_a[None, :], axis=1)
        if R2 > 0:
            b_z2 = (tl.sum(b_zp2, axis=0) * inv_c).to(w_dtype).to(tl.float32)
            b_a2 = (b_z2 * tl.sigmoid(b_z2)).to(w_dtype).to(tl.float32)
            b_g += tl.sum(b_up2.to(tl.float32) * b_a2[None, :], axis=1)
        b_g = b_g.to(w_dtype)  # g in the weights' dtype
        b_sg = tl.sigmoid(b_g.to(tl.float32)).to(w_dtype)
        b_m = (b_sg.to(tl.float32) * b_n.to(tl.float32)).to(p_u.dtype.element_ty).to(tl.float32)
        b_u = tl.sum(tl.reshape(b_m, (C, BLOCK_D)), axis=0) / C
        tl.store(p_u + t * stride_ut + i_d * BLOCK_D + tl.arange(0, BLOCK_D), b_u.to(p_u.dtype.element_ty),
                 mask=i_d * BLOCK_D + tl.arange(0, BLOCK_D) < D)
        if GATES:
            if i_d == 0:
                o_c = tl.arange(0, BLOCK_C)
                m_c = o_c < C
                b_gp = tl.load(p_zp + (o_s[:, None] * T + t) * stride_zp + RANK + o_c[None, :],
                               mask=m_s[:, None] & m_c[None, :], other=0.0)
                if SK > 0:
                    b_gp = b_gp * rstd_s[:, None]
                tl.store(p_gl + t * stride_glt + o_c, (tl.sum(b_gp, axis=0) * inv_c).to(p_gl.dtype.element_ty),
                         mask=m_c)


@triton.jit
def _read_up_mix_dot_streams_kernel(p_a, p_up, p_n, p_u, T, D, stride_at, stride_upr, stride_nt, stride_ut,
                                    RANK: tl.constexpr, C: tl.constexpr, BLOCK_T: tl.constexpr,
                                    BLOCK_D: tl.constexpr, BLOCK_RK: tl.constexpr, PRECISION: tl.constexpr,
                                    PDL: tl.constexpr = False):
    """The form "dot"'s up projection and mix with every stream's up rows of the program in one tile: g
    for all C streams by one `tl.dot` a rank step ([BLOCK_T, BLOCK_RK] x [BLOCK_RK, C * BLOCK_D]); the
    rank loop is software-pipelined (cp.async), with as many stages as steps its copies all go out before
    the first dot."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_d = tl.program_id(0)
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_j = tl.arange(0, C * BLOCK_D)
    o_k = o_j // BLOCK_D
    o_d = i_d * BLOCK_D + o_j % BLOCK_D
    m_d = o_d < D
    w_dtype = p_up.dtype.element_ty
    b_g = tl.zeros((BLOCK_T, C * BLOCK_D), dtype=tl.float32)
    for r in range(0, RANK, BLOCK_RK):
        o_r = r + tl.arange(0, BLOCK_RK)
        m_r = o_r < RANK
        b_a = tl.load(p_a + o_t[:, None] * stride_at + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
        b_up = tl.load(p_up + (o_k * D + o_d)[:, None].to(tl.int64) * stride_upr + o_r[None, :],
                       mask=m_d[:, None] & m_r[None, :], other=0.0)
        b_g = tl.dot(b_a, tl.trans(b_up), b_g, input_precision=PRECISION)
    b_s = tl.sigmoid(b_g.to(w_dtype).to(tl.float32)).to(w_dtype)  # g in the weights' dtype, as its GEMM rounds
    b_n = tl.load(p_n + o_t[:, None] * stride_nt + (o_k * D + o_d)[None, :], mask=m_t[:, None] & m_d[None, :],
                  other=0.0)
    b_m = (b_s.to(tl.float32) * b_n.to(tl.float32)).to(p_u.dtype.element_ty).to(tl.float32)
    b_u = tl.sum(tl.reshape(b_m, (BLOCK_T, C, BLOCK_D)), axis=1) / C
    o_dd = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    tl.store(p_u + o_t[:, None] * stride_ut + o_dd[None, :], b_u.to(p_u.dtype.element_ty),
             mask=m_t[:, None] & (o_dd < D)[None, :])


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, W] with unit column stride (any row stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def grouped_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """As `grouped_rms_norm_ref` for x [T, groups * D]."""
    t, width = x.shape
    d = width // groups
    x = _rows(x)
    out = torch.empty((t, width), dtype=x.dtype, device=x.device)
    if t:
        _grouped_norm_kernel[(t, groups)](x, weight.contiguous(), out, d, eps, x.stride(0), out.stride(0),
                                          BLOCK_D=triton.next_power_of_2(d), num_warps=4, **pdl_args(x.device))
    return out


def hc_mix_triton(g: torch.Tensor, n: torch.Tensor, streams: int) -> torch.Tensor:
    """As `hc_mix_ref`: g, n [T, C*D] -> u [T, D] in the dtype g * n promotes to."""
    t, width = n.shape
    d = width // streams
    g, n = _rows(g), _rows(n)
    u = torch.empty((t, d), dtype=torch.promote_types(g.dtype, n.dtype), device=n.device)
    block = min(1024, triton.next_power_of_2(d))
    if t:
        _mix_kernel[(t, triton.cdiv(d, block))](g, n, u, d, g.stride(0), n.stride(0), u.stride(0), C=streams,
                                                BLOCK_D=block, num_warps=4, **pdl_args(n.device))
    return u


def hc_write_triton(x: torch.Tensor, y: torch.Tensor, gate_logits: torch.Tensor, streams: int,
                    next_norm: torch.Tensor | None = None, eps: float = 1e-6
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As `hc_write_ref`: x [T, C*D], y [T, D], gate_logits [T, C] (any row strides); with next_norm
    also the next read's normalised streams. Grid (T, C): one program a stream of a row."""
    t, width = x.shape
    d = width // streams
    x, y, a = _rows(x), _rows(y), _rows(gate_logits)
    out = torch.empty((t, width), dtype=x.dtype, device=x.device)
    nn = torch.empty_like(out) if next_norm is not None else out
    block_d = triton.next_power_of_2(d)
    if t:
        _write_kernel[(t, streams)](x, y, a, next_norm.contiguous() if next_norm is not None else a, out, nn, eps,
                                    x.stride(0), y.stride(0), a.stride(0), out.stride(0), nn.stride(0),
                                    D=d, BLOCK_D=block_d, NEXT_NORM=next_norm is not None,
                                    num_warps=8 if block_d >= 2048 else 4,
                                    # no contraction: x + bf16(a y) must round twice, as the reference (and
                                    # `_write_down_deferred_kernel`) does; fused, sm_90 ran it as one bf16 FMA
                                    # (HFMA2.BF16_V2), a bf16 ulp off at ties (session 38, H100)
                                    enable_fp_fusion=False, **pdl_args(x.device))
    return out if next_norm is None else (out, nn)


def hc_write_read_triton(x: torch.Tensor, y: torch.Tensor, gate_logits: torch.Tensor, streams: int,
                         next_norm: torch.Tensor, eps: float, mix_in: torch.Tensor, up: torch.Tensor, rank: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`hc_write_read_ref` in two launches (`_write_down_deferred_kernel`, then the form "fma"'s up/mix kernel): x
    [T, C*D], y [T, D], gate_logits [T, C] (the write's), next_norm [C*D], mix_in [rank (+ C), C*D], up
    [C*D, rank] -> (x' [T, C*D], u [T, D], the next write's gate logits [T, C] or None). For the reads
    the form "fma" takes (a token); C a power of two."""
    opts = kernel_options().hyper_connection
    t, width = x.shape
    c, d, r = streams, width // streams, mix_in.shape[0]
    x, y, a, mix_in, up = _rows(x), _rows(y), _rows(gate_logits), _rows(mix_in), _rows(up)
    out = torch.empty((t, width), dtype=x.dtype, device=x.device)
    u = torch.empty((t, d), dtype=torch.promote_types(out.dtype, mix_in.dtype), device=x.device)
    next_gates = torch.empty((t, c), dtype=mix_in.dtype, device=x.device) if r > rank else None
    if t:
        sk, span, rows, r_stride = _deferred_down_tiles(d, r, opts)
        z_part = torch.empty((c * sk, t, r_stride), dtype=torch.float32, device=x.device)
        ss = torch.empty((c * sk, t), dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(span)
        _write_down_deferred_kernel[(triton.cdiv(r, rows), c * sk)](
            x, y, a, next_norm.contiguous(), mix_in, out, z_part, ss, t, r, x.stride(0), y.stride(0), a.stride(0),
            out.stride(0), mix_in.stride(0), r_stride, C=c, D=d, SK=sk, SPAN=span, ROWS=rows, BLOCK=block,
            num_warps=8 if rows * block >= 8192 else 4,
            enable_fp_fusion=False,  # x + bf16(a y) rounds twice, as `_write_kernel` (see there)
            **pdl_args(x.device))
        _read_up_fma(z_part, c * sk, r_stride, out, up, rank, c, opts, u, next_gates, norm=(next_norm, ss, eps, sk))
    return out, u, next_gates


def hc_read_triton(n: torch.Tensor, mix_in: torch.Tensor, up: torch.Tensor, rank: int, streams: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `hc_read_ref` (n [T, C*D] the normalised streams, mix_in [rank (+ C), C*D], up [C*D, rank]) ->
    (u [T, D] in the dtype n * mix_in promotes to, the gate logits [T, C] in mix_in's dtype, or None when
    mix_in has no inject rows): the form "fma" for reads of at most
    `HyperConnectionOptions.fma_read_max_tokens` tokens (each token a CUDA-core pass over the weight
    tiles a program loaded), else "dot" (tensor-core tiles of 16 tokens or more); the tiles are
    `HyperConnectionOptions`'. Meant for short reads (decode)."""
    opts = kernel_options().hyper_connection
    t, width = n.shape
    n, mix_in, up = _rows(n), _rows(mix_in), _rows(up)
    u = torch.empty((t, width // streams), dtype=torch.promote_types(n.dtype, mix_in.dtype), device=n.device)
    gate_logits = torch.empty((t, streams), dtype=mix_in.dtype, device=n.device) if mix_in.shape[0] > rank else None
    if t:
        read = _read_fma if t <= opts.fma_read_max_tokens else _read_dot
        read(n, mix_in, up, rank, streams, opts, u, gate_logits)
    return u, gate_logits


def _fma_down_tiles(width: int, r: int, opts) -> tuple[int, int, int, int]:
    """(chunk, splits, rows, r_stride) of the form "fma"'s down launch for streams of `width` columns and
    mix_in's r rows."""
    chunk = min(opts.down_chunk, triton.next_power_of_2(width))
    # the up kernel loads a token's partials as one tile: rows padded to 16 floats keep its loads 16-byte
    r_stride = triton.cdiv(r, 16) * 16
    return chunk, triton.cdiv(width, chunk), min(opts.down_rows, triton.next_power_of_2(r)), r_stride


def _deferred_down_tiles(d: int, r: int, opts) -> tuple[int, int, int, int]:
    """(chunks a stream, columns a chunk, rows, r_stride) of `_write_down_deferred_kernel` for streams of d
    columns and mix_in's r rows: each stream cut into equal chunks of at most `down_chunk` columns (a
    multiple of 16, so every chunk starts on a 32-byte boundary of bf16 rows)."""
    sk = triton.cdiv(d, opts.down_chunk)
    span = triton.cdiv(triton.cdiv(d, sk), 16) * 16
    return sk, span, min(opts.down_rows, triton.next_power_of_2(r)), triton.cdiv(r, 16) * 16


def _read_fma(n: torch.Tensor, mix_in: torch.Tensor, up: torch.Tensor, rank: int, c: int, opts, u: torch.Tensor,
              gate_logits: torch.Tensor | None) -> None:
    """`hc_read_triton`'s form "fma" into u (and gate_logits): two launches, a token at a time."""
    t, width = n.shape
    r = mix_in.shape[0]
    chunk, splits, rows, r_stride = _fma_down_tiles(width, r, opts)
    z_part = torch.empty((splits, t, r_stride), dtype=torch.float32, device=n.device)
    _read_down_kernel[(triton.cdiv(r, rows), splits)](n, mix_in, z_part, t, r, width, n.stride(0), mix_in.stride(0),
                                                      r_stride, ROWS=rows, CHUNK=chunk,
                                                      num_warps=8 if rows * chunk >= 8192 else 4, **pdl_args(n.device))
    _read_up_fma(z_part, splits, r_stride, n, up, rank, c, opts, u, gate_logits)


def _read_up_fma(z_part: torch.Tensor, splits: int, r_stride: int, n: torch.Tensor, up: torch.Tensor, rank: int, c: int,
                 opts, u: torch.Tensor, gate_logits: torch.Tensor | None,
                 norm: tuple[torch.Tensor, torch.Tensor, float, int] | None = None) -> None:
    """The form "fma"'s second launch: the partials' sum, SiLU, the up projection and the gated mean. With
    norm (the norm weight [C*D], the chunks' sums of squares [splits, T], eps, chunks a stream), n holds
    the written streams and the partials their un-normalised dots (`_write_down_deferred_kernel`)."""
    t, width = n.shape
    d = width // c
    block_r, r2 = triton.next_power_of_2(rank), 0
    if block_r != rank:  # rank = 2^a + (the rest in a tile of its own)
        block_r = block_r // 2
        r2 = triton.next_power_of_2(rank - block_r)
    gl = gate_logits if gate_logits is not None else u
    block_d = min(opts.up_block_d, triton.next_power_of_2(d))
    wn, ss, eps, sk = norm if norm is not None else (z_part, z_part, 0.0, 0)
    _read_up_mix_streams_kernel[(triton.cdiv(d, block_d),)](
        z_part, up, n, u, gl, t, splits, r_stride, d, 1.0 / c, up.stride(0), n.stride(0), u.stride(0), gl.stride(0),
        wn, ss, eps, RANK=rank, C=c, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_C=triton.next_power_of_2(c), GATES=gate_logits is not None, SK=sk, R2=r2,
        num_warps=opts.up_warps or (8 if c * block_d * (block_r + r2) >= 16384 else 4),
        # the norm's extra work takes the flagship tile (4 columns, 4 warps) from 104 registers a thread to
        # 153 on sm_90 (three programs an SM instead of four); capped at 128 it keeps four (32 bytes of
        # spills; at 8 columns and 8 warps: 101 -> 137, one program an SM instead of two)
        **({"maxnreg": 128} if sk and not opts.up_warps else {}), **pdl_args(n.device))


_DOT_UP_TILE_ELEMENTS = 16384  # BLOCK_T x BLOCK_RK at most: 32 tokens x 512 or 64 x 256


def _read_dot(n: torch.Tensor, mix_in: torch.Tensor, up: torch.Tensor, rank: int, c: int, opts, u: torch.Tensor,
              gate_logits: torch.Tensor | None) -> None:
    """`hc_read_triton`'s form "dot" into u (and gate_logits): three launches, every token at once on
    tensor cores."""
    t, width = n.shape
    d, r = width // c, mix_in.shape[0]
    precision = "ieee" if mix_in.dtype == torch.float32 else "tf32"
    block_t = max(16, triton.next_power_of_2(t))
    chunk = max(16, min(opts.dot_down_chunk, triton.next_power_of_2(width)))
    block_k = max(16, min(opts.dot_down_block_k, chunk))
    splits = triton.cdiv(width, chunk)
    z_part = torch.empty((splits, t, r), dtype=torch.float32, device=n.device)
    rows = opts.dot_down_rows
    _read_down_dot_kernel[(triton.cdiv(r, rows), splits)](n, mix_in, z_part, t, r, width, n.stride(0), mix_in.stride(0),
                                                          BLOCK_T=block_t, ROWS=rows, CHUNK=chunk, BLOCK_K=block_k,
                                                          PRECISION=precision, num_warps=4, num_stages=3,
                                                          **pdl_args(n.device))
    a = torch.empty((t, rank), dtype=mix_in.dtype, device=n.device)  # silu(z): the up projection's input
    gl = gate_logits if gate_logits is not None else a
    _read_reduce_kernel[(t,)](z_part, a, gl, t, splits, r, rank, 1.0 / c, a.stride(0), gl.stride(0),
                              BLOCK_R=triton.next_power_of_2(r), GATES=gate_logits is not None, num_warps=4,
                              **pdl_args(n.device))
    # rank steps copied by cp.async, every step in flight at once (one stage more than the steps)
    block_d = max(16 // c, min(opts.dot_up_block_d, triton.next_power_of_2(d)))
    # (the step capped so the pipelined activation tiles fit shared memory: a whole rank of 512 at 64 tokens
    # asked 240 KiB of the H200's 227 KiB in the first form)
    block_rk = max(16, min(opts.dot_up_block_rank, triton.next_power_of_2(rank), _DOT_UP_TILE_ELEMENTS // block_t))
    _read_up_mix_dot_streams_kernel[(triton.cdiv(d, block_d),)](
        a, up, n, u, t, d, a.stride(0), up.stride(0), n.stride(0), u.stride(0), RANK=rank, C=c, BLOCK_T=block_t,
        BLOCK_D=block_d, BLOCK_RK=block_rk, PRECISION=precision, num_warps=4,
        num_stages=min(8, triton.cdiv(rank, block_rk) + 1), **pdl_args(n.device))
