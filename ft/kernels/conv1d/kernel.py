"""Triton causal depthwise conv1d over a packed batch of sequences (details module of `ft.kernels.conv1d`).

`causal_conv1d_varlen_triton` is one launch, whatever the batch: programs over (tile of BLOCK_T tokens
of one sequence, block of BLOCK_C channels). A sequence's tiles start at its own first token, so no
tile straddles two sequences; tile j of sequence b is program `cu[b] // BLOCK_T + b + j` of the first
grid axis (each sequence owns `cu[b+1] // BLOCK_T - cu[b] // BLOCK_T + 1 >= ceil(len / BLOCK_T)`
program ids; the spare ones exit at once), found from the program id by a binary search over
cu_seqlens. The grid is `T // BLOCK_T + B` by `C / BLOCK_C`: shapes only, no host sync.

Each tap w of the window reads the input `W - 1 - w` tokens back: inside the sequence from x, before
its start from the sequence's conv state (its last W-1 inputs before this batch). Only tile 0 of a
sequence can reach before the start (BLOCK_T >= W-1), so tile 0 alone reads the old state, and tile 0
alone writes the new one (the last W-1 inputs of [old state, x]: from x, or partly from the old state
for a sequence shorter than W-1), after all of its own loads (a barrier): no other program touches
that slot, so one launch needs no grid-wide ordering.

Two kernels take that grid and contract: `_conv_varlen_rows_kernel` (`Conv1dOptions.rows`, the default for W <= 4)
walks its BLOCK_T tokens a row at a time with the window in registers, each input row loaded once;
`_conv_varlen_kernel` (wider windows, and variant "conv1d-tiles") computes [BLOCK_T, BLOCK_C] tiles, loading each
input row once a tap (2.1x slower at 16K tokens on the H100: `Conv1dOptions`). They share the tile lookup
(`_program_tile`) and the new state (`_new_state`).

EVEN_C (C a multiple of BLOCK_C, set by `conv_varlen_config`): the [BLOCK_T, BLOCK_C] tiles of x and
y are masked by their tokens alone, so that their loads and stores vectorize (16 bytes per thread);
a mask against the runtime C makes every element a load of its own. Same values either way.

Casts follow `causal_conv1d_ref` (and the decode kernel): the window in x's dtype, the products summed
in fp32 and rounded to the weight's dtype, SiLU in fp32 rounded to the weight's dtype, then to x's.
The fp32 sum runs over the taps in order (torch's conv may sum in another order): 16-bit outputs can
differ by an occasional last-place rounding. The new state is a copy: bit-exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.backend import TRITON_DTYPES
from ft.kernels.options import kernel_options

__all__ = ["VARLEN_UNSPECIALIZED", "conv_rows_config", "conv_varlen_config", "causal_conv1d_varlen_triton"]

# NOTE: the batch's integers and its cu_seqlens / slots pointers are not specialized: a mixed step's slots are a
# slice after its decoding rows (at an offset that is not a multiple of 16 bytes when one row decodes), and B may
# be 1 or a multiple of 16, each of which Triton would compile apart on a user's request (session 60 saw it
# through `ft serve`); they are read as scalars, so nothing is lost
VARLEN_UNSPECIALIZED = ["p_cu", "p_slots", "B", "n_iters"]


@triton.jit
def find_seq(p_cu, i_prog, n_seqs, n_iters, BLOCK: tl.constexpr):
    """The sequence b that program id `i_prog` belongs to: the largest b < n_seqs with
    cu[b] // BLOCK + b <= i_prog (that key strictly increases with b). A binary search of n_iters
    scalar loads (n_iters >= bit length of n_seqs)."""
    lo = i_prog * 0
    hi = lo + n_seqs - 1
    for _ in range(n_iters):
        mid = (lo + hi + 1) // 2
        key = tl.load(p_cu + mid) // BLOCK + mid
        ok = key <= i_prog
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _program_tile(p_cu, p_slots, i_p, B, C, n_iters, BLOCK_T: tl.constexpr):
    """Program `i_p`'s tile of BLOCK_T tokens (the module's docstring): (its sequence's start (int64) and length,
    the tile's index in the sequence, its first token t_lo relative to the start, c_end (the channels it covers: C,
    or 0 for a spare program past its sequence's last tile, which then does nothing; tile 0 always covers C, so a
    0-length sequence's tile 0 rewrites the old state as it was), the sequence's slot (int64)). Limits through
    tl.where, not a scalar bool in a mask (the interpreter rejects those)."""
    i_b = find_seq(p_cu, i_p, B, n_iters, BLOCK_T)
    start = tl.load(p_cu + i_b)
    length = tl.load(p_cu + i_b + 1) - start
    i_tile = i_p - (start // BLOCK_T + i_b)
    t_lo = i_tile * BLOCK_T
    c_end = tl.where((t_lo < length) | (i_tile == 0), C, 0)
    slot = tl.load(p_slots + i_b).to(tl.int64)
    return start.to(tl.int64), length, i_tile, t_lo, c_end, slot


@triton.jit
def _new_state(p_x, p_cs, slot, start, length, o_c, c_end, i_tile, stride_xt, stride_css, stride_csc, stride_csw,
               dtype: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr):
    """A sequence's new conv state, the last W-1 inputs of [old state, x] (column j: index length + j), loaded by
    its tile 0 only: (b_new [BLOCK_C, BLOCK_W] in x's dtype, its store mask, o_w). The caller stores it after a
    barrier that follows every load of the old state."""
    o_w = tl.arange(0, BLOCK_W)
    m_new = (o_c < tl.where(i_tile == 0, c_end, 0))[:, None] & (o_w < W - 1)[None, :]
    o_cat = length + o_w  # index into [old state (W-1), x (length)]
    m_from_x = m_new & (o_cat >= W - 1)[None, :]
    m_from_s = m_new & (o_cat < W - 1)[None, :]
    b_nx = tl.load(p_x + (start + o_cat - (W - 1))[None, :] * stride_xt + o_c[:, None], mask=m_from_x, other=0.0)
    b_ns = tl.load(p_cs + slot * stride_css + o_c[:, None] * stride_csc + o_cat[None, :] * stride_csw,
                   mask=m_from_s, other=0.0)
    return tl.where(m_from_x, b_nx.to(dtype), b_ns.to(dtype)), m_new, o_w


@triton.jit(do_not_specialize=VARLEN_UNSPECIALIZED)
def _conv_varlen_kernel(
    p_x, p_w, p_cs, p_cu, p_slots, p_y, B, C, n_iters,
    stride_xt, stride_wc, stride_css, stride_csc, stride_csw, stride_yt,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    EVEN_C: tl.constexpr = False,
):
    """One tile of BLOCK_T tokens of one sequence by BLOCK_C channels (the module's docstring). EVEN_C:
    C % BLOCK_C == 0, so every channel of the block exists: the x, old state and y tiles are masked by
    their tokens alone (a spare program's tokens are all masked: t_lo >= length); the weights and the
    new state keep their channel masks (strided, and tile 0's alone)."""
    i_p = tl.program_id(0)
    i_c = tl.program_id(1)
    dtype = p_x.dtype.element_ty
    w_dtype = p_w.dtype.element_ty
    start, length, i_tile, t_lo, c_end, slot = _program_tile(p_cu, p_slots, i_p, B, C, n_iters, BLOCK_T)
    o_t = t_lo + tl.arange(0, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < c_end
    m_t = o_t < length
    if EVEN_C:
        m_tc = m_t[:, None]
    else:
        m_tc = m_t[:, None] & m_c[None, :]
    p_state = p_cs + slot * stride_css + o_c[None, :] * stride_csc  # [1, BLOCK_C]
    b_acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for w in tl.static_range(W):
        o_src = o_t - (W - 1) + w  # the input this tap reads, relative to the sequence's start
        m_x = m_tc & (o_src >= 0)[:, None]
        m_s = m_tc & (o_src < 0)[:, None]
        b_x = tl.load(p_x + (start + o_src)[:, None] * stride_xt + o_c[None, :], mask=m_x, other=0.0)
        b_s = tl.load(p_state + (W - 1 + o_src)[:, None] * stride_csw, mask=m_s, other=0.0).to(dtype)
        b_win = tl.where(m_x, b_x, b_s)  # in x's dtype, as the reference's concatenation
        b_wt = tl.load(p_w + o_c * stride_wc + w, mask=m_c, other=0.0)
        b_acc += b_win.to(w_dtype).to(tl.float32) * b_wt.to(tl.float32)[None, :]
    b_y = b_acc.to(w_dtype).to(tl.float32)
    b_y = (b_y / (1.0 + tl.exp(-b_y))).to(w_dtype).to(dtype)
    b_new, m_new, o_w = _new_state(p_x, p_cs, slot, start, length, o_c, c_end, i_tile, stride_xt, stride_css,
                                   stride_csc, stride_csw, dtype, W, BLOCK_W)
    tl.debug_barrier()  # NOTE: every load of the old state before the stores that overwrite it
    tl.store(p_y + (start + o_t)[:, None] * stride_yt + o_c[None, :], b_y, mask=m_tc)
    tl.store(p_cs + slot * stride_css + o_c[:, None] * stride_csc + o_w[None, :] * stride_csw,
             b_new.to(p_cs.dtype.element_ty), mask=m_new)


@triton.jit
def _tap(acc, h, wt, w_dtype: tl.constexpr):
    """acc + h * wt in fp32, h (the window's input, x's dtype) rounded to the weight's dtype first (as the tile
    kernel and the reference cast the window)."""
    return acc + h.to(w_dtype).to(tl.float32) * wt


@triton.jit
def _window_row(p_x, p_state, start, t_lo, o_c, C, live, stride_xt, stride_csw, K: tl.constexpr, W: tl.constexpr,
                dtype: tl.constexpr):
    """Input t_lo - K of a sequence ([BLOCK_C] channels at o_c, x's dtype): x's row where t_lo >= K, else the
    old state's column W - 1 + t_lo - K (p_state: the slot's channels); zeros where `live` is false."""
    from_x = o_c < tl.where(live & (t_lo >= K), C, 0)
    from_s = o_c < tl.where(live & (t_lo < K), C, 0)
    b_x = tl.load(p_x + (start + t_lo - K) * stride_xt + o_c, mask=from_x, other=0.0)
    b_s = tl.load(p_state + (W - 1 + t_lo - K) * stride_csw, mask=from_s, other=0.0).to(dtype)
    return tl.where(from_x, b_x, b_s)


@triton.jit(do_not_specialize=VARLEN_UNSPECIALIZED)
def _conv_varlen_rows_kernel(
    p_x, p_w, p_cs, p_cu, p_slots, p_y, B, C, n_iters,
    stride_xt, stride_wc, stride_css, stride_csc, stride_csw, stride_yt,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    EVEN_C: tl.constexpr = False,
):
    """The tile kernel's contract (same grid mapping, same casts and tap order, the same new state), a token
    row at a time: the program walks its BLOCK_T tokens of one sequence with the last W-1 inputs held in
    registers (h1 = x[t-1], h2 = x[t-2], h3 = x[t-3]), so each input row is loaded once and each output row
    stored once, [BLOCK_C] channels wide (the tile kernel loads every row W times, once a tap). W <= 4.
    EVEN_C: C % BLOCK_C == 0: the token loop's rows are unmasked (16-byte loads and stores; a mask against a
    runtime limit makes every element an access of its own, as the sm_90 SASS showed). Only programs with
    tokens enter the loop, so its rows need no other mask."""
    tl.static_assert(W >= 2 and W <= 4, "the rows kernel holds at most three past inputs (W <= 4)")
    i_p = tl.program_id(0)
    i_c = tl.program_id(1)
    dtype = p_x.dtype.element_ty
    w_dtype = p_w.dtype.element_ty
    start, length, i_tile, t_lo, c_end, slot = _program_tile(p_cu, p_slots, i_p, B, C, n_iters, BLOCK_T)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    m_c = o_c < c_end
    live = t_lo < length  # (a spare program and an empty sequence's tile 0 read no input)
    p_state = p_cs + slot * stride_css + o_c * stride_csc
    # the taps' weights, fp32; tap k multiplies x[t - (W - 1) + k]
    w0 = tl.load(p_w + o_c * stride_wc, mask=m_c, other=0.0).to(tl.float32)
    w1 = tl.load(p_w + o_c * stride_wc + 1, mask=m_c, other=0.0).to(tl.float32)
    w2 = w1
    w3 = w1
    if W >= 3:
        w2 = tl.load(p_w + o_c * stride_wc + 2, mask=m_c, other=0.0).to(tl.float32)
    if W >= 4:
        w3 = tl.load(p_w + o_c * stride_wc + 3, mask=m_c, other=0.0).to(tl.float32)
    # the window before the first token, h_k = input t_lo - k: x inside the sequence, else the old state's
    # column W - 1 + t_lo - k (tile 0 only). Limits through tl.where, not a scalar bool in a mask (the
    # interpreter rejects those).
    h1 = _window_row(p_x, p_state, start, t_lo, o_c, C, live, stride_xt, stride_csw, 1, W, dtype)
    h2 = h1
    h3 = h1
    if W >= 3:
        h2 = _window_row(p_x, p_state, start, t_lo, o_c, C, live, stride_xt, stride_csw, 2, W, dtype)
    if W >= 4:
        h3 = _window_row(p_x, p_state, start, t_lo, o_c, C, live, stride_xt, stride_csw, 3, W, dtype)
    rows = tl.minimum(length - t_lo, BLOCK_T)  # (<= 0 for a spare program: no token)
    m_row = o_c < C
    for r in range(0, rows):
        t = start + t_lo + r
        if EVEN_C:
            x_t = tl.load(p_x + t * stride_xt + o_c)
        else:
            x_t = tl.load(p_x + t * stride_xt + o_c, mask=m_row, other=0.0)
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        if W == 4:
            acc = _tap(acc, h3, w0, w_dtype)
            acc = _tap(acc, h2, w1, w_dtype)
            acc = _tap(acc, h1, w2, w_dtype)
            acc = _tap(acc, x_t, w3, w_dtype)
        elif W == 3:
            acc = _tap(acc, h2, w0, w_dtype)
            acc = _tap(acc, h1, w1, w_dtype)
            acc = _tap(acc, x_t, w2, w_dtype)
        else:
            acc = _tap(acc, h1, w0, w_dtype)
            acc = _tap(acc, x_t, w1, w_dtype)
        b_y = acc.to(w_dtype).to(tl.float32)
        b_y = (b_y / (1.0 + tl.exp(-b_y))).to(w_dtype).to(dtype)
        if EVEN_C:
            tl.store(p_y + t * stride_yt + o_c, b_y)
        else:
            tl.store(p_y + t * stride_yt + o_c, b_y, mask=m_row)
        h3 = h2
        h2 = h1
        h1 = x_t
    # the new state (tile 0 only), after the loop (not held in registers through it): the old state is this
    # program's alone, so it is still the old one here
    b_new, m_new, o_w = _new_state(p_x, p_cs, slot, start, length, o_c, c_end, i_tile, stride_xt, stride_css,
                                   stride_csc, stride_csw, dtype, W, BLOCK_W)
    tl.debug_barrier()  # NOTE: every load of the old state (the window's and the new state's) before it is overwritten
    tl.store(p_cs + slot * stride_css + o_c[:, None] * stride_csc + o_w[None, :] * stride_csw,
             b_new.to(p_cs.dtype.element_ty), mask=m_new)


def conv_rows_config(channels: int, width: int) -> dict:
    """Constexprs and launch options of `_conv_varlen_rows_kernel` (`Conv1dOptions.rows`): BLOCK_T tokens a
    program (at least W-1: only tile 0 reads the old state) by BLOCK_C channels, from `Conv1dOptions.rows_launch`.
    Not measured on a device yet."""
    launch = dict(kernel_options().conv1d.rows_launch)
    block_c = min(launch.get("BLOCK_C", 1024), triton.next_power_of_2(channels))
    block_t = max(launch.get("BLOCK_T", 64), triton.next_power_of_2(width - 1))
    return {"W": width, "BLOCK_T": block_t, "BLOCK_C": block_c, "BLOCK_W": triton.next_power_of_2(width),
            "EVEN_C": channels % block_c == 0, "num_warps": launch.get("num_warps", 4),
            "num_stages": launch.get("num_stages", 3)}


def conv_varlen_config(channels: int, width: int) -> dict:
    """Constexprs and warps of `_conv_varlen_kernel`: tiles of 16 tokens by 64 channels, 4 warps.
    Measured on the H200 (C = 8192, W = 4, bf16; bench/gated_delta_prefill.py): 0.18 ms per 4,096
    tokens, 0.63 per 16,384 in one sequence; 32 x 128 with 8 warps 0.24 and 0.86. Still far from
    the copy bandwidth (~0.03 ms per 4,096 tokens): latency-bound at low occupancy (a tile's loads
    take ~100 registers a thread); not tuned further yet. EVEN_C: C % BLOCK_C == 0 (no channel masks
    on the x and y tiles)."""
    change = dict(kernel_options().conv1d.varlen_launch)  # (a sweep's launch choices, if any)
    block_c = change.get("BLOCK_C", min(64, triton.next_power_of_2(channels)))
    block_t = max(change.get("BLOCK_T", 16), triton.next_power_of_2(width - 1))  # NOTE: >= W-1: only tile 0 reads the state
    return {"W": width, "BLOCK_T": block_t, "BLOCK_C": block_c, "BLOCK_W": triton.next_power_of_2(width),
            "EVEN_C": channels % block_c == 0, "num_warps": change.get("num_warps", 4)}


def search_iters(n_seqs: int) -> int:
    """Steps of `find_seq`'s binary search over n_seqs sequences (the range halves each step)."""
    return max(1, int(n_seqs).bit_length())


def check_varlen(x, cu_seqlens, slots) -> int:
    """-> B; ValueError on cu_seqlens or slots the kernels do not take."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64) \
            or cu_seqlens.device != x.device:
        raise ValueError(f"cu_seqlens must be [B+1] int32/int64 on {x.device}, got {tuple(cu_seqlens.shape)} "
                         f"{cu_seqlens.dtype} on {cu_seqlens.device}")
    bsz = cu_seqlens.numel() - 1
    if slots.shape != (bsz,) or slots.dtype not in (torch.int32, torch.int64) or slots.device != x.device:
        raise ValueError(f"slots must be [B] = ({bsz},) int32/int64 on {x.device}, got {tuple(slots.shape)} "
                         f"{slots.dtype} on {slots.device}")
    return bsz


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU over sequences packed along T, in one launch; the same math as
    `causal_conv1d_ref` per sequence.

    Args:
        x: [T, C] the sequences' new inputs, back to back (unit stride along C; any row stride).
        conv_state: [S, C, W-1] (any strides, x's dtype or another): sequence b's state at slots[b]
            (its last W-1 inputs before x; zeros for a new sequence) is read as the left context and
            replaced by the last W-1 inputs of [state, x] (old state columns for a sequence shorter than W-1).
        weight: [C, W] (unit stride along W).
        cu_seqlens: [B+1] int32/int64 on x's device: sequence b is x[cu[b]:cu[b+1]]; cu[0] = 0, cu[B] = T,
            nondecreasing (not checked: that would sync).
        slots: [B] int32/int64 on x's device, distinct, in range (not checked).
        out: optional y [T, C] in x's dtype with unit stride along C.
    Returns:
        y [T, C] in x's dtype.
    Raises:
        ValueError on shapes or dtypes the kernel does not take.
    """
    if x.dim() != 2 or x.dtype not in TRITON_DTYPES:
        raise ValueError(f"x must be [T, C] in one of {TRITON_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    t, c = x.shape
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise ValueError(f"weight must be [C, W] = [{c}, >= 2], got {tuple(weight.shape)}")
    width = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (c, width - 1):
        raise ValueError(f"conv_state must be [S, C, W-1] = [S, {c}, {width - 1}], got {tuple(conv_state.shape)}")
    bsz = check_varlen(x, cu_seqlens, slots)
    if out is None:
        out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    elif out.shape != (t, c) or out.dtype != x.dtype or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out must be [T, C] = {(t, c)} {x.dtype} with unit stride along C, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if bsz == 0 or c == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    rows = kernel_options().conv1d.rows and width <= 4
    cfg = conv_rows_config(c, width) if rows else conv_varlen_config(c, width)
    grid = (t // cfg["BLOCK_T"] + bsz, triton.cdiv(c, cfg["BLOCK_C"]))
    (_conv_varlen_rows_kernel if rows else _conv_varlen_kernel)[grid](
        x, weight, conv_state, cu_seqlens, slots, out, bsz, c, search_iters(bsz),
        x.stride(0), weight.stride(0), *conv_state.stride(), out.stride(0), **cfg)
    return out
