"""Triton RMSNorms and the fused q/k norm + partial rotary (details module of `ft.kernels.norm`).

Every kernel keeps a row of D in one tile (D <= MAX_D) and follows its reference's arithmetic and
casts: sums of squares in fp32, the mean and rsqrt correctly rounded (`div_rn`, `sqrt_rn`, as the
CPU's 1/sqrt), intermediate roundings to the activation dtype where the reference has them. Only
the order of the fp32 sum differs (and fma contraction on the GPU), so fp32 agrees to ~1e-7 and
bf16/fp16 to an occasional last-place rounding.

- `_rms_norm_kernel`: one program per row; with HAS_RESIDUAL it first adds the residual in the
  activation dtype and stores that sum (the new residual): one launch for `h = h + x; rms_norm(h)`.
- `_gated_rms_norm_kernel`: BLOCK_R rows of Dv per program (Dv = 128 rows are small).
- `_qk_norm_rope_kernel`: one program per (token, head) over q's heads then k's; the head's row is
  normalised, then its first R dims rotated with cos/sin of positions * inv_freq taken in-kernel.
  The two rotary halves are re-read as [HALF] tiles (cache hits) and normalised again with the same
  ops, so each half meets its partner elementwise.

Each kernel takes EVEN_D (D == BLOCK_D, set by its wrapper): no mask against D (`_load_row`,
`_store_row`; a [rows, BLOCK_D] tile keeps its row mask), so that the row's loads and stores
vectorize (16 bytes per thread); a mask against the runtime D makes every element a load of its own.
Same values either way.

Outputs may be the inputs (in place): a row belongs to one program, which loads all it reads,
then passes a barrier (tiles smaller than the program replicate elements across warps), then stores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.backend import TRITON_DTYPES
from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["MAX_D", "add_rms_norm_triton", "gated_rms_norm_triton", "qk_norm_rope_triton", "rms_norm_triton"]

MAX_D = 8192
"""The longest row the kernels take (one tile); the dispatchers run the references past it."""


@triton.jit
def _load_row(p, o_d, D, EVEN_D: tl.constexpr):
    """p[o_d] for a row tile o_d = 0..BLOCK_D-1: elements o_d >= D are 0 (not read), unless EVEN_D (the
    caller knows D == BLOCK_D), which loads without a mask so that the compiler vectorizes the loads."""
    if EVEN_D:
        return tl.load(p + o_d)
    else:
        return tl.load(p + o_d, mask=o_d < D, other=0.0)


@triton.jit
def _store_row(p, o_d, b_y, D, EVEN_D: tl.constexpr):
    """p[o_d] = b_y for o_d < D (`_load_row`'s EVEN_D: every o_d, no mask)."""
    if EVEN_D:
        tl.store(p + o_d, b_y)
    else:
        tl.store(p + o_d, b_y, mask=o_d < D)


@triton.jit
def rms_rstd(b_x, D, eps):
    """1 / sqrt(mean(x^2) + eps) of a row tile [BLOCK_D] (masked lanes 0), rounded as torch on the CPU."""
    b_ms = tl.math.div_rn(tl.sum(b_x * b_x, axis=0), D.to(tl.float32))
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(b_ms + eps))


@triton.jit(do_not_specialize=["D"])
def _rms_norm_kernel(p_x, p_r, p_w, p_y, p_h, D, eps, stride_xt, stride_rt, stride_yt, stride_ht,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    """One row per program. EVEN_D: D == BLOCK_D (no mask along D: `_load_row`)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    b_x = _load_row(p_x + i_t * stride_xt, o_d, D, EVEN_D)
    if HAS_RESIDUAL:
        b_r = _load_row(p_r + i_t * stride_rt, o_d, D, EVEN_D)
        b_x = (b_r.to(tl.float32) + b_x.to(tl.float32)).to(p_h.dtype.element_ty)  # residual + x in x's dtype
    b_h = b_x
    b_x = b_x.to(tl.float32)
    b_w = _load_row(p_w, o_d, D, EVEN_D).to(tl.float32)
    b_y = (b_x * rms_rstd(b_x, D, eps)) * (1.0 + b_w)
    tl.debug_barrier()  # NOTE: every load before any store, so the outputs may alias the inputs
    if HAS_RESIDUAL:
        _store_row(p_h + i_t * stride_ht, o_d, b_h, D, EVEN_D)
    _store_row(p_y + i_t * stride_yt, o_d, b_y.to(p_y.dtype.element_ty), D, EVEN_D)


@triton.jit(do_not_specialize=["N", "D"])
def _gated_rms_norm_kernel(p_x, p_g, p_w, p_y, N, D, eps, stride_xt, stride_gt, stride_yt, G_ROWS, stride_gg,
                           ROUND_WY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                           EVEN_D: tl.constexpr = False, PDL: tl.constexpr = False, SIGMOID: tl.constexpr = False):
    """Rows of x, y at stride_xt, stride_yt; gate row r at (r // G_ROWS) * stride_gg + (r % G_ROWS) *
    stride_gt, so that a strided [T, H, D] gate (a view of a wider projection) needs no copy.
    EVEN_D: D == BLOCK_D (the [BLOCK_R, BLOCK_D] tiles masked by their rows alone, the weight row not
    at all: `_load_row`). SIGMOID: the gate is sigmoid(g), else silu(g)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m_r = o_r < N
    if EVEN_D:
        m_rd = m_r[:, None]
    else:
        m_rd = m_r[:, None] & (o_d < D)[None, :]
    b_x = tl.load(p_x + o_r[:, None] * stride_xt + o_d[None, :], mask=m_rd, other=0.0).to(tl.float32)
    b_ms = tl.math.div_rn(tl.sum(b_x * b_x, axis=1), D.to(tl.float32))
    b_rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(b_ms + eps))
    # NOTE: the reference's roundings: y in x's dtype, weight * y in promote(weight, x), the rest fp32
    b_y = (b_x * b_rstd[:, None]).to(p_y.dtype.element_ty).to(tl.float32)
    b_w = _load_row(p_w, o_d, D, EVEN_D).to(tl.float32)
    b_wy = b_w[None, :] * b_y
    if ROUND_WY:
        b_wy = b_wy.to(p_y.dtype.element_ty).to(tl.float32)
    o_g = (o_r // G_ROWS) * stride_gg + (o_r % G_ROWS) * stride_gt
    b_g = tl.load(p_g + o_g[:, None] + o_d[None, :], mask=m_rd, other=0.0).to(tl.float32)
    if SIGMOID:
        b_act = 1.0 / (1.0 + tl.exp(-b_g))
    else:
        b_act = b_g / (1.0 + tl.exp(-b_g))
    tl.debug_barrier()  # NOTE: every load before any store, so the output may alias the inputs
    tl.store(p_y + o_r[:, None] * stride_yt + o_d[None, :], (b_wy * b_act).to(p_y.dtype.element_ty), mask=m_rd)


@triton.jit
def _norm_half(p_x, p_w, o_h, m_h, b_rstd, dtype: tl.constexpr):
    """Normalised x[o_h] as the full row computes it, rounded to dtype (held in fp32)."""
    b_x = tl.load(p_x + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_w = tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)
    return ((b_x * b_rstd) * (1.0 + b_w)).to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_head(p_x, p_w, p_y, p_inv, b_pos, D, HALF, eps, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    EVEN_D: tl.constexpr):
    """One head: RMSNorm over D, rotate-half over the first 2 * HALF dims; p_x, p_y at the head's row.
    EVEN_D: D == BLOCK_D (the whole row's loads without a mask: `_load_row`)."""
    dtype = p_y.dtype.element_ty
    o_d = tl.arange(0, BLOCK_D)
    b_x = _load_row(p_x, o_d, D, EVEN_D).to(tl.float32)
    b_rstd = rms_rstd(b_x, D, eps)
    b_w = _load_row(p_w, o_d, D, EVEN_D).to(tl.float32)
    b_y = (b_x * b_rstd) * (1.0 + b_w)
    o_h = tl.arange(0, BLOCK_HALF)
    m_h = o_h < HALF
    b_x1 = _norm_half(p_x, p_w, o_h, m_h, b_rstd, dtype)
    b_x2 = _norm_half(p_x, p_w, HALF + o_h, m_h, b_rstd, dtype)
    b_f = b_pos * tl.load(p_inv + o_h, mask=m_h, other=0.0)
    b_cos = tl.cos(b_f).to(dtype).to(tl.float32)
    b_sin = tl.sin(b_f).to(dtype).to(tl.float32)
    # NOTE: the reference rounds each product to dtype before the sum: out = x * cos + rotate_half(x) * sin
    b_o1 = (b_x1 * b_cos).to(dtype).to(tl.float32) + (-(b_x2 * b_sin)).to(dtype).to(tl.float32)
    b_o2 = (b_x2 * b_cos).to(dtype).to(tl.float32) + (b_x1 * b_sin).to(dtype).to(tl.float32)
    tl.debug_barrier()  # NOTE: every load before any store, so the outputs may alias the inputs
    m_rest = o_d >= 2 * HALF  # past the rotary dims: the norm alone
    if not EVEN_D:
        m_rest = m_rest & (o_d < D)
    tl.store(p_y + o_d, b_y.to(dtype), mask=m_rest)
    tl.store(p_y + o_h, b_o1.to(dtype), mask=m_h)
    tl.store(p_y + HALF + o_h, b_o2.to(dtype), mask=m_h)


@triton.jit(do_not_specialize=["D", "HALF"])
def _qk_norm_rope_kernel(p_q, p_k, p_qw, p_kw, p_pos, p_inv, p_qo, p_ko, HQ, D, HALF, eps,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                         BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, EVEN_D: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """One (token, head) per program, q's heads then k's. EVEN_D: D == BLOCK_D (`_norm_rope_head`)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    b_pos = tl.load(p_pos + i_t).to(tl.float32)
    if i_h < HQ:
        _norm_rope_head(p_q + i_t * stride_qt + i_h * stride_qh, p_qw, p_qo + i_t * stride_qot + i_h * stride_qoh,
                        p_inv, b_pos, D, HALF, eps, BLOCK_D, BLOCK_HALF, EVEN_D)
    else:
        i_k = i_h - HQ
        _norm_rope_head(p_k + i_t * stride_kt + i_k * stride_kh, p_kw, p_ko + i_t * stride_kot + i_k * stride_koh,
                        p_inv, b_pos, D, HALF, eps, BLOCK_D, BLOCK_HALF, EVEN_D)


def norm_warps(block: int) -> int:
    """1 warp per 256 elements of a tile, 1 to 8."""
    return max(1, min(8, block // 256))


def _rows(x: torch.Tensor, d: int) -> torch.Tensor:
    """x [..., D] as rows [N, D] with unit stride along D (a view where torch can make one)."""
    rows = x.reshape(-1, d)
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def _out_rows(out: torch.Tensor | None, like: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output tensor, its rows [N, D] viewed in place); fresh and contiguous when out is None."""
    if out is None:
        out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    elif out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    try:
        rows = out.view(-1, like.shape[-1])
    except RuntimeError:
        rows = None  # its rows do not share one stride
    if rows is None or (rows.numel() and rows.stride(-1) != 1):
        raise ValueError(f"{name} needs rows of one stride with unit stride along the last dimension")
    return out, rows


def _check(x: torch.Tensor, weight: torch.Tensor, what: str) -> int:
    d = x.shape[-1]
    if x.dtype not in TRITON_DTYPES:
        raise ValueError(f"{what}: dtype {x.dtype} is not one of {TRITON_DTYPES}")
    if not 1 <= d <= MAX_D:
        raise ValueError(f"{what}: rows of {d} outside 1..{MAX_D}")
    if weight.shape != (d,):
        raise ValueError(f"{what}: weight {tuple(weight.shape)} for rows of {d}")
    return d


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D], weight [D] -> x * rsqrt(mean(x^2) + eps) * (1 + weight) in x's dtype, as `rms_norm_ref`.

    out: optional output like x (may be x itself). Raises: ValueError for a dtype outside
    TRITON_DTYPES, D above MAX_D or a weight not [D]."""
    d = _check(x, weight, "rms_norm")
    rows = _rows(x, d)
    out, y = _out_rows(out, x, "out")
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, y, y, d, eps, rows.stride(0), rows.stride(0),
                                           y.stride(0), y.stride(0), HAS_RESIDUAL=False, BLOCK_D=block,
                                           EVEN_D=d == block, num_warps=norm_warps(block), **pdl_args(x.device))
    return out


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., D] (same dtype), weight [D] -> (rms_norm(residual + x), residual + x), one launch.

    out, residual_out: optional outputs like x; residual_out may be `residual` (updated in place).
    Raises: ValueError as `rms_norm_triton`, or for a residual unlike x."""
    d = _check(x, weight, "add_rms_norm")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} {residual.dtype} unlike x "
                         f"{tuple(x.shape)} {x.dtype}")
    rows, r = _rows(x, d), _rows(residual, d)
    out, y = _out_rows(out, x, "out")
    residual_out, h = _out_rows(residual_out, x, "residual_out")
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows.shape[0],)](rows, r, weight, y, h, d, eps, rows.stride(0), r.stride(0), y.stride(0),
                                           h.stride(0), HAS_RESIDUAL=True, BLOCK_D=block, EVEN_D=d == block,
                                           num_warps=norm_warps(block), **pdl_args(x.device))
    return out, residual_out


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """x, gate [..., D], weight [D] -> weight * rmsnorm(x) * act(gate) in x's dtype, as `gated_rms_norm_ref`
    (act: "silu" or "sigmoid").

    out: optional output like x (may be x). Raises: ValueError as `rms_norm_triton`, or for a gate
    of another shape or an activation of another name."""
    if activation not in ("silu", "sigmoid"):
        raise ValueError(f"gated_rms_norm: activation {activation!r}, not one of ('silu', 'sigmoid')")
    d = _check(x, weight, "gated_rms_norm")
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} unlike x {tuple(x.shape)}")
    rows = _rows(x, d)
    if gate.dim() == 3 and gate.stride(-1) == 1:  # [T, H, D], any strides: rows in groups of H, no copy
        g, g_rows, stride_g, stride_gg = gate, gate.shape[1], gate.stride(1), gate.stride(0)
    else:
        g = _rows(gate, d)
        g_rows, stride_g, stride_gg = max(1, g.shape[0]), g.stride(0), 0
    out, y = _out_rows(out, x, "out")
    n = rows.shape[0]
    if n:
        block = triton.next_power_of_2(d)
        block_r = max(1, min(triton.next_power_of_2(n), 1024 // block))
        round_wy = torch.promote_types(weight.dtype, x.dtype) == x.dtype
        _gated_rms_norm_kernel[(triton.cdiv(n, block_r),)](rows, g, weight, y, n, d, eps, rows.stride(0), stride_g,
                                                            y.stride(0), g_rows, stride_gg, ROUND_WY=round_wy, BLOCK_R=block_r,
                                                            BLOCK_D=block, EVEN_D=d == block,
                                                            SIGMOID=activation == "sigmoid",
                                                            num_warps=norm_warps(block_r * block), **pdl_args(x.device))
    return out


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    eps: float,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k RMSNorm then partial rotary in one launch, as `qk_norm_rope_ref`. Out of place by default.

    q [T, Hq, D] and k [T, Hk, D], any strides with unit stride along D (q may be the view of a
    [T, Hq, 2D] tensor); q_weight, k_weight [D]; positions [T] integer; inv_freq [rotary_dim / 2]
    float32. Returns new contiguous (q, k), or writes q_out / k_out (like q / k, unit stride along D,
    possibly q / k themselves: in place). cos/sin are rounded to q's dtype, as the model's.
    Raises: ValueError for mismatched shapes or dtypes, an odd rotary_dim or one above D."""
    t, hq, d = q.shape
    _check(q, q_weight, "qk_norm_rope q")
    _check(k, k_weight, "qk_norm_rope k")
    if k.shape[0] != t or k.shape[2] != d or k.dtype != q.dtype or positions.shape != (t,):
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, "
                         f"positions {tuple(positions.shape)} do not match")
    if rotary_dim % 2 or not 2 <= rotary_dim <= d or inv_freq.shape != (rotary_dim // 2,):
        raise ValueError(f"qk_norm_rope: rotary_dim {rotary_dim} with {tuple(inv_freq.shape)} frequencies, D {d}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    for name, o, x in (("q_out", q_out, q), ("k_out", k_out, k)):
        if o.shape != x.shape or o.dtype != x.dtype or o.stride(-1) != 1:
            raise ValueError(f"qk_norm_rope: {name} must be {tuple(x.shape)} {x.dtype} with unit stride along D")
    if t:
        block, half = triton.next_power_of_2(d), rotary_dim // 2
        _qk_norm_rope_kernel[(t, hq + k.shape[1])](
            q, k, q_weight, k_weight, positions, inv_freq.float(), q_out, k_out, hq, d, half, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), BLOCK_D=block, BLOCK_HALF=triton.next_power_of_2(half),
            EVEN_D=d == block, num_warps=norm_warps(block), **pdl_args(q.device))
    return q_out, k_out
