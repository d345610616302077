"""Triton MoE over expert slots for NVFP4 slot pools (details module of `ft.kernels.moe`).

Two launches, no host synchronization and no grouping pass (decode-shaped: every (token, k)
pair reads its expert's weights, which L2 shares between pairs of one expert):

1. `_moe_gate_up_kernel`, grid (pairs, I / BLOCK_I): ``h[p] = silu(x[t] @ gate^T) * (x[t] @ up^T)``
   for pair p = t * k + j of slot ``topk_slots[t, j]``; fp32 workspace h [T * k, I].
2. `_moe_down_kernel`, grid (T, H / BLOCK_H): ``out[t] = sum_j weight[t, j] * (h[p] @ down^T)``,
   the weighted sum per token done in registers (no atomics).

Slot -1 means "skip this pair" (computed in another call): its loads are masked off and it adds
nothing. Weights are read in the slot pool's layout (`ft.kernels.moe.SlotWeights`), E2M1 and
E4M3 decoded as in `ft.kernels.nvfp4_triton`; per-slot global scales (gate, up, down) in the
epilogues. Not yet measured on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.baselines.nvfp4_triton_v1 import _e2m1_hi, _e2m1_lo, _e4m3

__all__ = ["moe_over_slots_triton"]


@triton.jit
def _dot_rows(p_w, p_s, o_r, m_r, stride_wr, stride_sr, p_v, half_k,
              BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr):
    """sum_k W[o_r, k] * v[k] for NVFP4 rows o_r (packed at p_w, scales at p_s), v at p_v -> fp32 [BLOCK_R].

    half_k: bytes per row (K / 2); 0 gives zeros without reading anything (a skipped pair)."""
    G: tl.constexpr = BLOCK_KB // 8
    acc = tl.zeros((BLOCK_R, BLOCK_KB), dtype=tl.float32)
    for kb in range(0, half_k, BLOCK_KB):
        o_kb = kb + tl.arange(0, BLOCK_KB)
        o_g = kb // 8 + tl.arange(0, G)
        m_k = o_kb < half_k
        m_w = m_r[:, None] & m_k[None, :]
        b_w = tl.load(p_w + o_r[:, None] * stride_wr + o_kb[None, :], mask=m_w, other=0)
        m_s = m_r[:, None] & (o_g < half_k // 8)[None, :]
        b_s = _e4m3(tl.load(p_s + o_r[:, None] * stride_sr + o_g[None, :], mask=m_s, other=0)) * 64.0
        b_s = tl.reshape(tl.broadcast_to(b_s[:, :, None], (BLOCK_R, G, 8)), (BLOCK_R, BLOCK_KB))
        b_ve = tl.load(p_v + 2 * o_kb, mask=m_k, other=0.0).to(tl.float32)
        b_vo = tl.load(p_v + 2 * o_kb + 1, mask=m_k, other=0.0).to(tl.float32)
        acc += (_e2m1_lo(b_w) * b_ve[None, :] + _e2m1_hi(b_w) * b_vo[None, :]) * b_s
    return tl.sum(acc, axis=1)


@triton.jit
def _moe_gate_up_kernel(
    p_x, p_slots, p_w13, p_s13, p_s2, p_h,
    I, H, TOPK,
    stride_xt, stride_w13e, stride_w13r, stride_s13e, stride_s13r, stride_s2e, stride_ht,
    BLOCK_I: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_i = tl.program_id(1)
    slot = tl.load(p_slots + i_p)
    m_on = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)  # NOTE: masked loads only when the pair is skipped
    o_i = i_i * BLOCK_I + tl.arange(0, BLOCK_I)
    m_i = o_i < I
    p_w = p_w13 + slot * stride_w13e
    p_s = p_s13 + slot * stride_s13e
    p_v = p_x + (i_p // TOPK) * stride_xt
    b_g = _dot_rows(p_w, p_s, o_i, m_i, stride_w13r, stride_s13r, p_v, tl.where(m_on, H // 2, 0), BLOCK_I, BLOCK_KB)
    b_u = _dot_rows(p_w, p_s, o_i + I, m_i, stride_w13r, stride_s13r, p_v, tl.where(m_on, H // 2, 0), BLOCK_I, BLOCK_KB)
    b_g = b_g * tl.load(p_s2 + slot * stride_s2e)  # slot clamped to 0: a valid address
    b_u = b_u * tl.load(p_s2 + slot * stride_s2e + 1)
    b_h = b_g / (1.0 + tl.exp(-b_g)) * b_u
    tl.store(p_h + i_p * stride_ht + o_i, b_h, mask=m_i)


@triton.jit
def _moe_down_kernel(
    p_h, p_slots, p_wts, p_w2, p_s2w, p_s2, p_out,
    I, H, TOPK,
    stride_ht, stride_w2e, stride_w2r, stride_s2we, stride_s2wr, stride_s2e, stride_ot,
    BLOCK_H: tl.constexpr, BLOCK_KB: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(TOPK):
        i_p = i_t * TOPK + j
        slot = tl.load(p_slots + i_p)
        m_on = slot >= 0
        slot = tl.maximum(slot, 0).to(tl.int64)
        b_y = _dot_rows(p_w2 + slot * stride_w2e, p_s2w + slot * stride_s2we, o_h, m_h, stride_w2r, stride_s2wr,
                        p_h + i_p * stride_ht, tl.where(m_on, I // 2, 0), BLOCK_H, BLOCK_KB)
        b_wt = tl.load(p_wts + i_p).to(tl.float32) * tl.load(p_s2 + slot * stride_s2e + 2)
        acc += tl.where(m_on, b_y * b_wt, 0.0)
    tl.store(p_out + i_t * stride_ot + o_h, acc.to(p_out.dtype.element_ty), mask=m_h)


# (BLOCK rows, BLOCK_KB bytes, num_warps) of the gate_up and the down pass; tuned on the H200
GATE_UP_CONFIG = (8, 256, 4)
DOWN_CONFIG = (8, 128, 4)


def moe_over_slots_triton(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w, *, out: torch.Tensor | None = None,
    gate_up_config: tuple[int, int, int] | None = None, down_config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """sum_k weight_k * down(silu(gate(x)) * up(x)) with NVFP4 experts read from slots.

    Args:
        x: [T, H] fp32/bf16/fp16; topk_slots: [T, k] integer slots, -1 = skip the pair;
        topk_weights: [T, k]; w: an NVFP4 `SlotWeights`; out: optional [T, H] in x's dtype.
    Returns: [T, H] in x's dtype.
    Raises: ValueError for dense slot pools or mismatched shapes.
    """
    if not w.is_nvfp4:
        raise ValueError("moe_over_slots_triton takes NVFP4 slot pools only")
    t, hid = x.shape
    i = w.w13.shape[1] // 2
    if w.w13.shape[2] * 2 != hid or w.w2.shape[1] != hid or w.w2.shape[2] * 2 != i or i % 16 or hid % 16:
        raise ValueError(f"slot pool shapes {tuple(w.w13.shape)}, {tuple(w.w2.shape)} do not match x {tuple(x.shape)}")
    if topk_slots.shape != topk_weights.shape or topk_slots.shape[0] != t:
        raise ValueError(f"topk_slots {tuple(topk_slots.shape)} and topk_weights {tuple(topk_weights.shape)} must be [T, k]")
    k = topk_slots.shape[1]
    x = x.contiguous()
    slots = topk_slots.reshape(-1).to(torch.int32).contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    w13, w2 = w.w13.contiguous(), w.w2.contiguous()
    s13, s2w = w.w13_scale.contiguous().view(torch.uint8), w.w2_scale.contiguous().view(torch.uint8)
    s2 = w.scale_2.float().contiguous()
    h = torch.empty((t * k, i), dtype=torch.float32, device=x.device)
    y = torch.empty_like(x) if out is None else out
    if t == 0:
        return y
    block_i, kb13, warps13 = gate_up_config or GATE_UP_CONFIG
    block_h, kb2, warps2 = down_config or DOWN_CONFIG
    kb13 = max(16, min(kb13, triton.next_power_of_2(hid // 2)))
    kb2 = max(16, min(kb2, triton.next_power_of_2(i // 2)))
    _moe_gate_up_kernel[(t * k, triton.cdiv(i, block_i))](
        x, slots, w13, s13, s2, h, i, hid, k,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s2.stride(0), h.stride(0),
        BLOCK_I=block_i, BLOCK_KB=kb13, num_warps=warps13,
    )
    _moe_down_kernel[(t, triton.cdiv(hid, block_h))](
        h, slots, wts, w2, s2w, s2, y, i, hid, k,
        h.stride(0), w2.stride(0), w2.stride(1), s2w.stride(0), s2w.stride(1), s2.stride(0), y.stride(0),
        BLOCK_H=block_h, BLOCK_KB=kb2, num_warps=warps2,
    )
    return y
