"""Triton kernels of Gated DeltaNet's decode step (details module of `ft.kernels.gated_delta`).

One decode step of one layer is two launches, whatever the batch:

* `_conv_decode_kernel`, programs over (sequence, block of BLOCK_C channels): the window
  [old conv state (W-1 columns), new input] of each channel, y = silu(window . weight) into a small
  [B, C] buffer, and the shifted window (its last W-1 columns) written back as the new conv state.
* `_delta_decode_kernel`, programs over (sequence, value head, block of BLOCK_V value dims): q and
  k of the head's key head (h // (Hv / Hk)) L2-normalised in fp32 (recomputed by every program of
  the group: Dk values each), beta and the decay g from b, a, A_log and dt_bias, then the
  recurrent step on the state tile [Dk, BLOCK_V] in fp32, written back in place, and o.

Why two launches: a channel of q or k feeds every program of its key head's group (Hv / Hk heads
times Dv / BLOCK_V blocks), and the conv state update (a shift) overwrites the old column that
those programs read. One launch has no barrier between programs, so no program could know that all
readers are done before it writes; a grid of one program per key-head group (which would read and
write its channels alone) leaves 16 programs at batch 1 to stream 4 MiB of state. So the conv and
its state update come first, each channel read and written by one program only (loads, barrier,
stores), and the delta rule reads y from the buffer. The cost: one more launch (one more node in a
CUDA graph) and a [B, C] round trip in the activation dtype (16 KiB per sequence at the flagship's
C = 8192), against 2 x 2 MiB of fp32 state per sequence read and written by the second kernel.

Both kernels follow the references' casts: the window in x's dtype, the conv sum in fp32 rounded to
the weight's dtype, silu rounded to it then to x's dtype (as `causal_conv1d_ref`); beta = sigmoid(b)
rounded to b's dtype; norms with correctly rounded 1 / sqrt. Sums run in another order (and fma
contracts on the GPU), so fp32 agrees to ~1e-6 and 16-bit types to an occasional last-place rounding
of y. The conv state is a copy: bit-exact.

Slots are a device tensor; grids and block sizes depend on shapes only; the [B, C] buffer is
allocated by shape: capturable in a CUDA graph. A negative slot (a padding row) reads and writes
no state and gives o = 0. Slots must be distinct. Block sizes are not tuned on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.backend import TRITON_DTYPES
from ft.kernels.options import kernel_options
from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["BA_ROWS", "MAX_BA_WIDTH", "MAX_DK", "ba_proj_fits", "conv_config", "delta_config", "gated_delta_decode_triton"]

MAX_DK = 256
"""The largest key head dim the delta kernel takes (a state tile is [Dk, BLOCK_V] in registers)."""
MAX_BA_WIDTH = 8192
"""The widest hidden state whose in_proj_ba the conv launch computes (`ba_proj`: one tile of H a program)."""
BA_ROWS = 2
"""Rows of in_proj_ba a program of the conv launch computes (`ba_proj`): 48 programs for Hv = 48."""
TARGET_PROGRAMS = 256
"""The delta kernel narrows BLOCK_V until the grid has about this many programs (two per SM of an H200)."""


@triton.jit
def _conv_channels(p_x, p_w, p_cs, p_slots, p_y, C, stride_xb, stride_wc, stride_css, stride_csc, stride_csw,
                   stride_yb, i_b, i_c, W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    """`_conv_decode_kernel`'s work for the channels of block i_c of sequence i_b."""
    dtype = p_x.dtype.element_ty
    w_dtype = p_w.dtype.element_ty
    slot = tl.load(p_slots + i_b).to(tl.int64)
    c_end = tl.where(slot >= 0, C, 0)  # NOTE: a padding row touches nothing (a scalar bool mask fails in the interpreter)
    o_c = i_c * BLOCK_C + tl.arange(0, BLOCK_C)
    o_w = tl.arange(0, BLOCK_W)
    m_c = o_c < c_end
    m_state = m_c[:, None] & (o_w < W - 1)[None, :]
    p_row = p_cs + tl.maximum(slot, 0) * stride_css + o_c[:, None] * stride_csc  # [BLOCK_C, 1]
    b_x = tl.load(p_x + i_b * stride_xb + o_c, mask=m_c, other=0.0)
    b_old = tl.load(p_row + o_w[None, :] * stride_csw, mask=m_state, other=0.0).to(dtype)
    b_win = tl.where((o_w == W - 1)[None, :], b_x[:, None], b_old)  # [BLOCK_C, BLOCK_W] in x's dtype
    b_w = tl.load(p_w + o_c[:, None] * stride_wc + o_w[None, :], mask=m_c[:, None] & (o_w < W)[None, :], other=0.0)
    b_y = tl.sum(b_win.to(w_dtype).to(tl.float32) * b_w.to(tl.float32), axis=1).to(w_dtype).to(tl.float32)
    b_y = (b_y / (1.0 + tl.exp(-b_y))).to(w_dtype).to(dtype)
    # the new state: column j is the window's column j + 1 (the old state's, or x for the last)
    b_next = tl.load(p_row + (o_w + 1)[None, :] * stride_csw, mask=m_c[:, None] & (o_w < W - 2)[None, :], other=0.0)
    b_new = tl.where((o_w == W - 2)[None, :], b_x[:, None], b_next.to(dtype))
    tl.debug_barrier()  # NOTE: every load before any store: the stores overwrite columns other threads read
    tl.store(p_y + i_b * stride_yb + o_c, b_y, mask=m_c)
    tl.store(p_row + o_w[None, :] * stride_csw, b_new.to(p_cs.dtype.element_ty), mask=m_state)


@triton.jit
def _conv_decode_kernel(
    p_x, p_w, p_cs, p_slots, p_y, C,
    stride_xb, stride_wc, stride_css, stride_csc, stride_csw, stride_yb,
    p_h, p_wba, p_ba, N_BA, stride_hb, stride_wba, stride_bab,
    W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
    BA: tl.constexpr = False, ROWS_BA: tl.constexpr = 1, H: tl.constexpr = 16, BLOCK_H: tl.constexpr = 16,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    n_conv = tl.cdiv(C, BLOCK_C)
    if BA:
        # the grid's last programs: in_proj_ba's rows, ROWS_BA a program (b, a = h W_ba^T); H a constexpr (a
        # model's width) so that the mask past H keeps the loads 16 bytes wide
        if i_c >= n_conv:
            o_r = (i_c - n_conv) * ROWS_BA + tl.arange(0, ROWS_BA)
            m_r = o_r < N_BA
            o_h = tl.arange(0, BLOCK_H)
            m_h = o_h < H
            b_h = tl.load(p_h + i_b * stride_hb + o_h, mask=m_h, other=0.0).to(tl.float32)
            b_wba = tl.load(p_wba + o_r[:, None].to(tl.int64) * stride_wba + o_h[None, :],
                            mask=m_r[:, None] & m_h[None, :], other=0.0).to(tl.float32)
            b_ba = tl.sum(b_wba * b_h[None, :], axis=1)  # fp32, rounded once to the output's dtype (dense_linear's)
            tl.store(p_ba + i_b * stride_bab + o_r, b_ba.to(p_ba.dtype.element_ty), mask=m_r)
        else:
            _conv_channels(p_x, p_w, p_cs, p_slots, p_y, C, stride_xb, stride_wc, stride_css, stride_csc, stride_csw,
                           stride_yb, i_b, i_c, W, BLOCK_C, BLOCK_W)
    else:
        _conv_channels(p_x, p_w, p_cs, p_slots, p_y, C, stride_xb, stride_wc, stride_css, stride_csc, stride_csw,
                       stride_yb, i_b, i_c, W, BLOCK_C, BLOCK_W)


@triton.jit
def _l2norm(b_x):
    """x * 1 / sqrt(sum(x^2) + 1e-6) of a tile [BLOCK] in fp32 (masked lanes 0), rounded as torch on the CPU."""
    return b_x * tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.sum(b_x * b_x, axis=0) + 1e-6))


@triton.jit
def _log1p(b_x):
    """log(1 + x), accurate for small x (Goldberg's correction; libdevice's log1p is missing in the interpreter)."""
    b_u = 1.0 + b_x
    return tl.where(b_u == 1.0, b_x, tl.log(b_u) * (b_x / (b_u - 1.0)))


@triton.jit
def _delta_decode_kernel(
    p_y, p_b, p_a, p_alog, p_dt, p_ss, p_slots, p_o, HK, GROUP, DK, DV, scale,
    stride_yb, stride_bb, stride_ab, stride_sss, stride_ssh, stride_ssk, stride_ssv, stride_ob, stride_oh,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_k = i_h // GROUP  # the key head of value head i_h
    slot = tl.load(p_slots + i_b).to(tl.int64)
    k_end = tl.where(slot >= 0, DK, 0)  # NOTE: a padding row reads zeros, writes no state and gives o = 0
    v_end = tl.where(slot >= 0, DV, 0)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_k = o_k < k_end
    m_v = o_v < v_end
    m_kv = m_k[:, None] & m_v[None, :]
    # y [B, C]: q of every key head, then k, then v
    p_row = p_y + i_b * stride_yb
    b_q = tl.load(p_row + i_k * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(p_row + (HK + i_k) * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(p_row + 2 * HK * DK + i_h * DV + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_q = _l2norm(b_q) * scale
    b_k = _l2norm(b_k)
    b_b = tl.load(p_b + i_b * stride_bb + i_h)
    b_beta = tl.sigmoid(b_b.to(tl.float32)).to(p_b.dtype.element_ty).to(tl.float32)  # sigmoid in b's dtype
    b_a = tl.load(p_a + i_b * stride_ab + i_h).to(tl.float32) + tl.load(p_dt + i_h).to(tl.float32)
    b_softplus = tl.where(b_a > 20.0, b_a, _log1p(tl.exp(b_a)))  # torch's threshold
    b_g = -tl.exp(tl.load(p_alog + i_h).to(tl.float32)) * b_softplus
    # the state tile [BLOCK_K, BLOCK_V] of value head i_h, fp32
    p_s = (p_ss + tl.maximum(slot, 0) * stride_sss + i_h * stride_ssh + o_k[:, None] * stride_ssk
           + o_v[None, :] * stride_ssv)
    b_s = tl.load(p_s, mask=m_kv, other=0.0) * tl.exp(b_g)
    b_u = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta
    b_s = b_s + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_s * b_q[:, None], axis=0)
    tl.debug_barrier()  # NOTE: every load before any store (a small tile replicates elements across warps)
    tl.store(p_s, b_s, mask=m_kv)
    tl.store(p_o + i_b * stride_ob + i_h * stride_oh + o_v, b_o.to(p_o.dtype.element_ty), mask=o_v < DV)


def conv_config(channels: int, width: int) -> dict:
    """Constexprs and warps of `_conv_decode_kernel` (untuned)."""
    block_c = min(256, triton.next_power_of_2(channels))
    return {"W": width, "BLOCK_C": block_c, "BLOCK_W": triton.next_power_of_2(width),
            "num_warps": max(1, min(4, block_c // 64))}


def delta_config(batch: int, hv: int, dk: int, dv: int) -> dict:
    """Constexprs and warps of `_delta_decode_kernel`: the widest BLOCK_V (16 to 64) that still gives about
    TARGET_PROGRAMS programs, a warp per 2,048 state elements of the tile (1 to 4). Session 40's sweep (H200,
    bench/gated_delta_decode.py --sweep, us a layer, Dk = Dv = 128): Flash-Next's 48 heads at batch 1, BLOCK_V 16
    with 1 warp 6.92; at batch 8, 64 with 4 warps 20.35 against 24.82 with the 8 of a warp per 1,024; the 80B's
    32 heads 6.46 (16, 1 warp) against 6.73 (2) and 16.15 (64, 4) against 18.36 (8)."""
    block_k = triton.next_power_of_2(dk)
    block_v = min(64, triton.next_power_of_2(dv))
    while block_v > 16 and batch * hv * triton.cdiv(dv, block_v) < TARGET_PROGRAMS:
        block_v //= 2
    return {"BLOCK_K": block_k, "BLOCK_V": block_v, "num_warps": max(1, min(4, block_k * block_v // 2048))}


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along its last dimension (a copy only where it has not)."""
    return x if x.stride(-1) == 1 or x.numel() == 0 else x.contiguous()


def _check(mixed, b, a, conv_state, ssm_state, weight, a_log, dt_bias, slots) -> tuple[int, int, int, int, int]:
    """-> (Hk, Hv, Dk, Dv, W) from the shapes; ValueError on anything the kernels do not take."""
    if mixed.dim() != 2 or mixed.dtype not in TRITON_DTYPES:
        raise ValueError(f"mixed must be [B, C] in one of {TRITON_DTYPES}, got {tuple(mixed.shape)} {mixed.dtype}")
    bsz, c = mixed.shape
    if ssm_state.dim() != 4 or ssm_state.dtype != torch.float32:
        raise ValueError(f"ssm_state must be [S, Hv, Dk, Dv] float32, got {tuple(ssm_state.shape)} {ssm_state.dtype}")
    _, hv, dk, dv = ssm_state.shape
    if not 1 <= dk <= MAX_DK:
        raise ValueError(f"key head dim {dk} outside 1..{MAX_DK}")
    kd = c - hv * dv
    if kd <= 0 or kd % (2 * dk) or hv % (kd // (2 * dk)):
        raise ValueError(f"C = {c} is not 2 * Hk * {dk} + {hv} * {dv} with Hk dividing Hv = {hv}")
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 2:
        raise ValueError(f"weight must be [C, W] = [{c}, >= 2], got {tuple(weight.shape)}")
    width = weight.shape[1]
    if conv_state.shape != (ssm_state.shape[0], c, width - 1):
        raise ValueError(f"conv_state must be [S, C, W-1] = {(ssm_state.shape[0], c, width - 1)}, "
                         f"got {tuple(conv_state.shape)}")
    if b.shape != (bsz, hv) or a.shape != (bsz, hv) or a_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"b, a must be [B, Hv] = {(bsz, hv)} and a_log, dt_bias [Hv], got {tuple(b.shape)}, "
                         f"{tuple(a.shape)}, {tuple(a_log.shape)}, {tuple(dt_bias.shape)}")
    if slots.shape != (bsz,) or slots.dtype not in (torch.int32, torch.int64) or slots.device != mixed.device:
        raise ValueError(f"slots must be [B] = ({bsz},) int32/int64 on {mixed.device}, got {tuple(slots.shape)} "
                         f"{slots.dtype} on {slots.device}")
    return kd // (2 * dk), hv, dk, dv, width


def ba_proj_fits(h: torch.Tensor, w_ba: torch.Tensor, rows: int | None = None, hv: int | None = None) -> bool:
    """Whether the conv launch computes b and a from h [B, H] and w_ba [2 Hv, H] (`ba_proj`): one dtype the
    kernels take, one device, unit stride along H <= MAX_BA_WIDTH; B and Hv the launch's where given. The
    dispatcher's choice and the launcher's check, one rule."""
    return (h.dim() == 2 and w_ba.dim() == 2 and h.dtype == w_ba.dtype and h.dtype in TRITON_DTYPES
            and 1 <= h.shape[1] <= MAX_BA_WIDTH and w_ba.shape[1] == h.shape[1] and w_ba.shape[0] % 2 == 0
            and h.stride(-1) == 1 and w_ba.stride(-1) == 1 and h.device == w_ba.device
            and (rows is None or h.shape[0] == rows) and (hv is None or w_ba.shape[0] == 2 * hv))


def gated_delta_decode_triton(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
    ba_proj: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet decode step in two launches; same contract as `gated_delta_decode_ref`.

    mixed [B, C], b, a [B, Hv], conv_state [S, C, W-1] (activation dtype, any strides), ssm_state
    [S, Hv, Dk, Dv] float32 (any strides), weight [C, W], a_log, dt_bias [Hv], slots [B] int32/int64
    (distinct; negative: padding) -> o [B, Hv, Dv] in mixed's dtype; the states at slots updated in place.
    out: optional output [B, Hv, Dv] with unit stride along Dv. ba_proj: (h [B, H], w_ba [2 Hv, H]) of
    one dtype with unit stride along H, H <= `MAX_BA_WIDTH`, in place of b and a (both None): b, a =
    h w_ba^T (b's rows first) in h's dtype, computed by extra programs of the conv launch (what was
    in_proj_ba's own launch). Raises: ValueError on shapes or dtypes the kernels do not take (Dk above
    MAX_DK among them).
    """
    bsz, c = mixed.shape
    ba = None
    if ba_proj is not None:
        h, w_ba = ba_proj
        hv = ssm_state.shape[1] if ssm_state.dim() == 4 else 0
        if b is not None or a is not None or not ba_proj_fits(h, w_ba, bsz, hv):
            raise ValueError(f"ba_proj must be h [B, H] and w_ba [2 Hv, H] of one dtype, unit stride along H <= "
                             f"{MAX_BA_WIDTH}, with b and a None; got h {tuple(h.shape)} {h.dtype}, w_ba "
                             f"{tuple(w_ba.shape)} {w_ba.dtype}, Hv {hv}")
        ba = torch.empty(bsz, 2 * hv, dtype=h.dtype, device=mixed.device)  # NOTE: sized by shapes only (graph-safe)
        b, a = ba[:, :hv], ba[:, hv:]
    hk, hv, dk, dv, width = _check(mixed, b, a, conv_state, ssm_state, weight, a_log, dt_bias, slots)
    if out is None:
        out = torch.empty(bsz, hv, dv, dtype=mixed.dtype, device=mixed.device)
    elif out.shape != (bsz, hv, dv) or out.dtype != mixed.dtype or (out.numel() and out.stride(-1) != 1):
        raise ValueError(f"out must be [B, Hv, Dv] = {(bsz, hv, dv)} {mixed.dtype} with unit stride along Dv, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if bsz == 0:
        return out
    mixed, b, a, weight, a_log, dt_bias = (_unit_last(t) for t in (mixed, b, a, weight, a_log, dt_bias))
    y = torch.empty(bsz, c, dtype=mixed.dtype, device=mixed.device)  # NOTE: sized by shapes only (graph-safe)
    cfg = conv_config(c, width)
    programs = triton.cdiv(c, cfg["BLOCK_C"])
    if ba is None:
        ba_args = (mixed, weight, y, 0, 0, 0, 0)
    else:
        ba_args = (h, w_ba, ba, 2 * hv, h.stride(0), w_ba.stride(0), ba.stride(0))
        cfg.update(BA=True, ROWS_BA=BA_ROWS, H=h.shape[1], BLOCK_H=triton.next_power_of_2(h.shape[1]))
        programs += triton.cdiv(2 * hv, BA_ROWS)
    _conv_decode_kernel[(bsz, programs)](
        mixed, weight, conv_state, slots, y, c, mixed.stride(0), weight.stride(0), *conv_state.stride(), y.stride(0),
        *ba_args, **cfg, **pdl_args(mixed.device))
    cfg = {**delta_config(bsz, hv, dk, dv), **dict(kernel_options().gated_delta.decode_launch)}  # (a sweep's, if any)
    _delta_decode_kernel[(bsz, hv, triton.cdiv(dv, cfg["BLOCK_V"]))](
        y, b, a, a_log, dt_bias, ssm_state, slots, out, hk, hv // hk, dk, dv, dk ** -0.5,
        y.stride(0), b.stride(0), a.stride(0), *ssm_state.stride(), out.stride(0), out.stride(1), **cfg,
        **pdl_args(mixed.device))
    return out
