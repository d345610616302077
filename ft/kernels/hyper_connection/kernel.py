"""The HyperConnection kernels in Triton, one launch each (`reference.py` is the contract of each):

- `_grouped_norm_kernel`, grid (T, C): stream k of row t normalised (fp32, rounded as the Qwen3-Next
  norm kernel rounds), times 1 + its weight row.
- `_mix_kernel`, grid (T, D / BLOCK_D): u = mean over the C streams of sigmoid(g_k) * n_k.
- `_write_kernel`, grid (T, C): a_k = 2 sigmoid(logit_k) (the logits inject N / C come from the read's
  GEMM), x_k + a_k y, and optionally the next read's norm of that stream: the write and the next
  read's norm in one pass (what was ~8 torch launches). (A first form computed the C inject dots
  itself, one program a row: 16 us a call on the H200 at T = 1, 1.5 ms of an 8 ms step.)

- `_read_in_kernel`, grid (R / BLOCK_R, SPLIT), and `_read_out_kernel`, grid (D / BLOCK_D): a read's two
  low-rank projections and its gated mean at a few tokens (decode), where cuBLAS runs two GEMMs, a
  split-K reduce, the SiLU and the mix: the first kernel sums N mix_in^T over SPLIT slices of the C*D
  columns (fp32 partials, no atomics: the result does not depend on the schedule), the second adds
  the partials in a fixed order, rounds z and its SiLU as the reference does, computes the C streams'
  rows of g = silu(z) up^T for BLOCK_D columns and mixes them into u there; its first program also
  writes the write's gate logits (z's last C columns). Prefill keeps cuBLAS. Their tiles are a
  `ReadForm` chosen by name (`READ_FORMS`).

Each rounds where the reference's torch ops round (to the activation or weight dtype between steps),
so that bf16 results stay the reference's but for the order of fp32 sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ft.kernels.norm.kernel import _rstd

__all__ = ["READ_FORMS", "ReadForm", "grouped_rms_norm_triton", "hc_mix_triton", "hc_read_triton", "hc_write_triton"]


@triton.jit
def _norm_stream(b_x, p_w, o_d, m_d, D, eps):
    """A stream's values b_x (fp32 [BLOCK_D], masked lanes 0) normalised times 1 + w (p_w its weight row)."""
    b_w = tl.load(p_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    return (b_x * _rstd(b_x, D, eps)) * (1.0 + b_w)


@triton.jit(do_not_specialize=["D"])
def _grouped_norm_kernel(p_x, p_w, p_y, D, eps, stride_xt, stride_yt, BLOCK_D: tl.constexpr):
    i_t, i_k = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_x = tl.load(p_x + i_t * stride_xt + i_k * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = _norm_stream(b_x, p_w + i_k * D, o_d, m_d, D, eps)
    tl.store(p_y + i_t * stride_yt + i_k * D + o_d, b_y.to(p_y.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["D"])
def _mix_kernel(p_g, p_n, p_u, D, stride_gt, stride_nt, stride_ut, C: tl.constexpr, BLOCK_D: tl.constexpr):
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


@triton.jit(do_not_specialize=["D"])
def _write_kernel(p_x, p_y, p_a, p_wn, p_out, p_nn, D, eps, stride_xt, stride_yt, stride_at, stride_ot, stride_nnt,
                  BLOCK_D: tl.constexpr, NEXT_NORM: tl.constexpr):
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
        b_nn = _norm_stream(tl.where(m_d, b_o.to(tl.float32), 0.0), p_wn + i_k * D, o_d, m_d, D, eps)
        tl.store(p_nn + i_t * stride_nnt + i_k * D + o_d, b_nn.to(p_nn.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["T", "W", "R", "K_SPLIT"])
def _read_in_kernel(p_n, p_w, p_z, T, W, R, K_SPLIT, stride_nt, stride_wr,
                    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                    PRECISION: tl.constexpr):
    # partial sums over the columns [i_s K_SPLIT, (i_s + 1) K_SPLIT) of N mix_in^T for BLOCK_R rows of
    # mix_in: p_z fp32 [SPLIT, BLOCK_T, R]; n rounded to the weights' dtype first (as the reference casts it).
    # DOT: tensor-core tiles (rows of x past T are zeros); else FMAs on a [T, R, K] broadcast
    WDT: tl.constexpr = p_w.dtype.element_ty
    i_r, i_s = tl.program_id(0), tl.program_id(1)
    o_t = tl.arange(0, BLOCK_T)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_t = o_t < T
    m_r = o_r < R
    k_lo = i_s * K_SPLIT
    if DOT:
        acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_T, BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k in range(k_lo, k_lo + K_SPLIT, BLOCK_K):
        o_k = k + tl.arange(0, BLOCK_K)
        m_k = o_k < W
        b_n = tl.load(p_n + o_t[:, None] * stride_nt + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_r[:, None] * stride_wr + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
        if DOT:
            acc = tl.dot(b_n.to(WDT), tl.trans(b_w), acc, input_precision=PRECISION)
        else:
            acc3 += b_n.to(WDT).to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :]
    if not DOT:
        acc = tl.sum(acc3, axis=2)
    tl.store(p_z + i_s * BLOCK_T * R + o_t[:, None] * R + o_r[None, :], acc, mask=m_t[:, None] & m_r[None, :])


@triton.jit
def _z_rounded(p_z, o_t, m_t, o_r, m_r, R, inv_c, C: tl.constexpr, SPLIT: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK: tl.constexpr, POW2: tl.constexpr, DT: tl.constexpr):
    """z [BLOCK_T, BLOCK] at columns o_r: `_read_in_kernel`'s partials summed in split order, divided by
    C and rounded to DT as the reference's GEMM rounds (once with 1 / C in the GEMM's alpha when C is a
    power of two; else the GEMM's rounding, then the division's) -> fp32 holding DT values."""
    m = m_t[:, None] & m_r[None, :]
    z = tl.zeros((BLOCK_T, BLOCK), dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        z += tl.load(p_z + s * BLOCK_T * R + o_t[:, None] * R + o_r[None, :], mask=m, other=0.0)
    if POW2:
        return (z * inv_c).to(DT).to(tl.float32)
    return (z.to(DT).to(tl.float32) / C).to(DT).to(tl.float32)


@triton.jit(do_not_specialize=["T", "D", "R", "RANK"])
def _read_out_kernel(p_z, p_up, p_n, p_u, p_a, T, D, R, RANK, inv_c, stride_upr, stride_nt, stride_ut, stride_at,
                     C: tl.constexpr, C_PAD: tl.constexpr, SPLIT: tl.constexpr, EXTRA: tl.constexpr,
                     POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_RK: tl.constexpr,
                     DOT: tl.constexpr, PRECISION: tl.constexpr):
    # the C streams' rows of up for columns [i_d BLOCK_D, ...) as one flat axis j: stream j // BLOCK_D
    DT: tl.constexpr = p_up.dtype.element_ty
    i_d = tl.program_id(0)
    o_t = tl.arange(0, BLOCK_T)
    m_t = o_t < T
    o_j = tl.arange(0, C_PAD * BLOCK_D)
    o_k = o_j // BLOCK_D
    o_d = i_d * BLOCK_D + o_j % BLOCK_D
    m_j = (o_k < C) & (o_d < D)
    o_row = o_k * D + o_d
    acc = tl.zeros((BLOCK_T, C_PAD * BLOCK_D), dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_RK):
        o_rk = r0 + tl.arange(0, BLOCK_RK)
        m_rk = o_rk < RANK
        z = _z_rounded(p_z, o_t, m_t, o_rk, m_rk, R, inv_c, C, SPLIT, BLOCK_T, BLOCK_RK, POW2, DT)
        act = (z * tl.sigmoid(z)).to(DT)  # SiLU in the weights' dtype (rows past T: silu(0) = 0)
        b_w = tl.load(p_up + o_row[:, None] * stride_upr + o_rk[None, :], mask=m_j[:, None] & m_rk[None, :], other=0.0)
        if DOT:
            acc = tl.dot(act, tl.trans(b_w), acc, input_precision=PRECISION)
        else:
            acc += tl.sum(act.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], axis=2)
    # g rounded as the up GEMM's output; then `_mix_kernel`'s arithmetic over the flat axis
    b_g = acc.to(DT).to(tl.float32)
    m_tj = m_t[:, None] & m_j[None, :]
    b_n = tl.load(p_n + o_t[:, None] * stride_nt + o_row[None, :], mask=m_tj, other=0.0)
    b_s = tl.sigmoid(b_g).to(DT)
    prod = (b_s.to(tl.float32) * b_n.to(tl.float32)).to(p_u.dtype.element_ty).to(tl.float32)
    prod = tl.where(m_tj, prod, 0.0)
    b_u = tl.sum(tl.reshape(prod, (BLOCK_T, C_PAD, BLOCK_D)), axis=1) / C
    o_du = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    tl.store(p_u + o_t[:, None] * stride_ut + o_du[None, :], b_u.to(p_u.dtype.element_ty),
             mask=m_t[:, None] & (o_du < D)[None, :])
    if EXTRA > 0:
        if i_d == 0:  # the write's gate logits: z's columns RANK .. RANK + EXTRA
            o_e = tl.arange(0, C_PAD)
            m_e = o_e < EXTRA
            b_a = _z_rounded(p_z, o_t, m_t, RANK + o_e, m_e, R, inv_c, C, SPLIT, BLOCK_T, C_PAD, POW2, DT)
            tl.store(p_a + o_t[:, None] * stride_at + o_e[None, :], b_a.to(p_a.dtype.element_ty),
                     mask=m_t[:, None] & m_e[None, :])


@dataclass(frozen=True)
class ReadForm:
    """How `hc_read_triton` tiles its two kernels. dot: tensor-core tiles (x's rows padded to 16); fma:
    FMAs on broadcasts, tiles sized by T. programs: `_read_in_kernel`'s programs to aim for (row tiles
    times K splits), enough to spread a read's weights over the H200's 132 SMs."""

    dot: bool
    in_rows: int
    in_k: int
    out_d: int
    out_k: int
    programs: int = 256


READ_FORMS = {
    "dot": ReadForm(dot=True, in_rows=16, in_k=256, out_d=16, out_k=64),
    "fma": ReadForm(dot=False, in_rows=4, in_k=0, out_d=16, out_k=0),  # in_k / out_k: by T (`_fma_tiles`)
}
READ_FORM = "dot"
"""`hc_read_triton`'s default form (bench/hc_read.py; bench/RESULTS.md)."""


def _fma_tiles(block_t: int, c_pad: int, out_d: int) -> tuple[int, int]:
    """The fma form's K tiles at BLOCK_T rows: ~8K fp32 products a program in flight."""
    return max(64, min(512, 2048 // block_t)), max(8, min(128, 8192 // (block_t * c_pad * out_d)))


def hc_read_triton(n: torch.Tensor, mix_in: torch.Tensor, up: torch.Tensor, rank: int, streams: int,
                   form: str | ReadForm = READ_FORM) -> tuple[torch.Tensor, torch.Tensor | None]:
    """As `hc_read_ref` (arguments as there) for a few tokens (T <= 16 in the dot form): u [T, D] in the
    dtype g * n promotes to, and the gate logits [T, C] in the weights' dtype (None when mix_in has no
    inject rows). Two launches, weights read once; `form`: a `READ_FORMS` name, or a `ReadForm` (tests)."""
    t, width = n.shape
    rows = mix_in.shape[0]
    extra = rows - rank
    d = width // streams
    if extra not in (0, streams) or up.shape != (width, rank) or mix_in.shape[1] != width:
        raise ValueError(f"mix_in {tuple(mix_in.shape)} and up {tuple(up.shape)} do not fit rank {rank}, "
                         f"{streams} streams of {d}")
    f = READ_FORMS[form] if isinstance(form, str) else form
    n, mix_in, up = _rows(n), _rows(mix_in), _rows(up)
    dt = mix_in.dtype
    u = torch.empty((t, d), dtype=torch.promote_types(dt, n.dtype), device=n.device)
    gate = torch.empty((t, extra), dtype=dt, device=n.device) if extra else None
    if t == 0:
        return u, gate
    c_pad = triton.next_power_of_2(streams)
    block_t = triton.next_power_of_2(t)
    if f.dot:
        block_t, in_k, out_k = max(16, block_t), f.in_k, f.out_k
    else:
        in_k, out_k = _fma_tiles(block_t, c_pad, f.out_d)
    precision = "ieee" if dt == torch.float32 else "tf32"
    row_tiles = triton.cdiv(rows, f.in_rows)
    split = max(1, min(triton.cdiv(f.programs, row_tiles), triton.cdiv(width, in_k)))
    k_split = triton.cdiv(triton.cdiv(width, split), in_k) * in_k
    split = triton.cdiv(width, k_split)
    z = torch.empty((split, block_t, rows), dtype=torch.float32, device=n.device)
    _read_in_kernel[(row_tiles, split)](n, mix_in, z, t, width, rows, k_split, n.stride(0), mix_in.stride(0),
                                       BLOCK_T=block_t, BLOCK_R=f.in_rows, BLOCK_K=in_k, DOT=f.dot,
                                       PRECISION=precision, num_warps=4)
    _read_out_kernel[(triton.cdiv(d, f.out_d),)](
        z, up, n, u, gate if gate is not None else u, t, d, rows, rank, 1.0 / streams, up.stride(0), n.stride(0),
        u.stride(0), gate.stride(0) if gate is not None else 0, C=streams, C_PAD=c_pad, SPLIT=split, EXTRA=extra,
        POW2=streams & (streams - 1) == 0, BLOCK_T=block_t, BLOCK_D=f.out_d, BLOCK_RK=out_k, DOT=f.dot,
        PRECISION=precision, num_warps=4)
    return u, gate


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
                                          BLOCK_D=triton.next_power_of_2(d), num_warps=4)
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
                                                BLOCK_D=block, num_warps=4)
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
        _write_kernel[(t, streams)](x, y, a, next_norm.contiguous() if next_norm is not None else a, out, nn, d, eps,
                                    x.stride(0), y.stride(0), a.stride(0), out.stride(0), nn.stride(0),
                                    BLOCK_D=block_d, NEXT_NORM=next_norm is not None,
                                    num_warps=8 if block_d >= 2048 else 4)
    return out if next_norm is None else (out, nn)
