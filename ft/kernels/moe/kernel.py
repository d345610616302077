"""Triton MoE over expert slots for NVFP4 slot pools (details module of `ft.kernels.moe`).

Two paths, both without host synchronization (they can be captured in CUDA graphs):

* Decode (T <= GROUPED_MIN_TOKENS): every (token, k) pair reads its expert (with a few tokens
  and hundreds of experts, pairs rarely share one). Two or three launches:
  1. `_moe_gate_up_kernel`, grid (pairs, I / BLOCK_I): ``h[p] = silu(x[t] @ gate^T) * (x[t] @ up^T)``
     for pair p = t * k + j of slot ``topk_slots[t, j]``; gate and up rows interleaved in one
     tile so that one pass over x reads both; fp32 workspace h [T * k, I].
  2. `_moe_down_pairs_kernel`, grid (T * k, H / BLOCK_H): ``yp[p] = weight_p * (h[p] @ down^T)``
     (fp32), then `moe_sum_pairs_kernel` sums over k per token (no atomics). (A down kernel of one
     program per token looping over its k experts lost to it: batch 1 23.6 -> 19.4 us, bench/RESULTS.md,
     session 2; it left the tree after commit d98949c.)
  Both run on `ft.kernels.nvfp4.kernel.nvfp4_rows_dot` (word-wise E2M1 decode, fp32 FMAs).
* Prefill (more tokens): pairs are grouped by slot into tiles of one slot, each a ``tl.dot`` GEMM
  against the slot's dequantized weight tiles (`grouped_kernel.py`): each expert's weights are
  read once per tile of its tokens, not once per token.

* The decode MoE block (`decode_kernel.moe_decode_triton`, what the model runs for up to 128 tokens): the same
  per-pair gate/up with the layer's shared expert as one more pair of each token (its own one-slot
  pool, chosen by pointer), then down per pair weighted by the routing weights (the shared
  expert's: the sigmoid of its gate) and one ordered fp32 sum per token: the routed experts, the
  shared expert and the combine of the unfused block in three launches instead of ten. A token's
  result depends on neither where its experts sit nor the batch's other tokens' routing.

Slot -1 means "skip this pair" (computed in another call): it reads nothing and adds nothing.
Weights are read in the slot pool's layout (`ft.kernels.moe.SlotWeights`); per-slot global
scales (gate, up, down) in the epilogues.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

from ft.kernels.options import kernel_options
from ft.kernels.backend import inline_ptx
from ft.kernels.moe.grouped_kernel import grouped_config_for, grouped_moe, grouped_pairs, sum_live_pairs
from ft.kernels.nvfp4.kernel import as_words, whole_k_words
from ft.kernels.nvfp4.rows import nvfp4_rows_dot, rows_dot_whole_k

__all__ = ["GROUPED_MIN_TOKENS", "moe_over_pools_triton", "moe_over_slots_triton"]

GROUPED_MIN_TOKENS = 128
"""Above this many tokens the grouped (tl.dot) path runs; at or below, the per-pair GEMV path.
H200, 10 of 512 experts (bench/RESULTS.md): per-pair ~9 us per token; grouped 1.0 ms at 64
tokens, 1.5 ms at 1024."""


@triton.jit
def _moe_gate_up_kernel(
    p_x, p_slots, p_w13, p_s13, p_s2, p_h,
    I, H, TOPK,
    stride_xt, stride_w13e, stride_w13r, stride_s13e, stride_s13r, stride_s2e, stride_ht,
    BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr, WHOLE_K: tl.constexpr = 0, ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_p = tl.program_id(0)
    i_i = tl.program_id(1)
    slot = tl.load(p_slots + i_p)
    on = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)  # a valid address; a skipped pair reads no weights
    # tile row 2q + g: gate (g = 0) or up (g = 1) row i_i * BLOCK_I + q
    o_q = tl.arange(0, 2 * BLOCK_I)
    o_i = i_i * BLOCK_I + o_q // 2
    o_r = o_i + (o_q % 2) * I
    if WHOLE_K > 0:  # H / 8 = WHOLE_K words in one tile
        b_gu = rows_dot_whole_k(p_w13 + slot * stride_w13e, p_s13 + slot * stride_s13e, o_r, o_i < tl.where(on, I, 0),
                                stride_w13r, stride_s13r, p_x + (i_p // TOPK) * stride_xt, WHOLE_K, 2 * BLOCK_I, ASM)
    else:
        o_t = tl.zeros((1,), dtype=tl.int32) + i_p // TOPK
        b_gu = nvfp4_rows_dot(p_w13 + slot * stride_w13e, p_s13 + slot * stride_s13e, o_r, o_i < I, stride_w13r,
                              stride_s13r, p_x, o_t, o_t >= 0, stride_xt, 0, tl.where(on, H // 8, 0), 1, 2 * BLOCK_I, BLOCK_W)
    b_g, b_u = tl.split(tl.reshape(b_gu, (BLOCK_I, 2)))
    b_g = b_g * tl.load(p_s2 + slot * stride_s2e)
    b_u = b_u * tl.load(p_s2 + slot * stride_s2e + 1)
    b_h = b_g / (1.0 + tl.exp(-b_g)) * b_u
    o_h = i_i * BLOCK_I + tl.arange(0, BLOCK_I)
    tl.store(p_h + i_p * stride_ht + o_h, b_h, mask=o_h < I)


@triton.jit
def _moe_down_pairs_kernel(
    p_h, p_slots, p_wts, p_w2, p_s2w, p_s2, p_yp,
    I, H,
    stride_ht, stride_w2e, stride_w2r, stride_s2we, stride_s2wr, stride_s2e, stride_yp,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, WHOLE_K: tl.constexpr = 0, ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (pairs, H / BLOCK_H): yp[p] = weight[p] * (h[p] @ down^T) in fp32, zeros for a skipped pair.
    Every pair's expert in flight at once (a token's program looping over its pairs reads them one by one)."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_p = tl.program_id(0)
    i_h = tl.program_id(1)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    slot = tl.load(p_slots + i_p)
    on = slot >= 0
    slot = tl.maximum(slot, 0).to(tl.int64)
    if WHOLE_K > 0:  # I / 8 = WHOLE_K words in one tile
        b_y = rows_dot_whole_k(p_w2 + slot * stride_w2e, p_s2w + slot * stride_s2we, o_h, o_h < tl.where(on, H, 0), stride_w2r,
                               stride_s2wr, p_h + i_p * stride_ht, WHOLE_K, BLOCK_H, ASM)[None, :]
    else:
        o_p = tl.zeros((1,), dtype=tl.int32) + i_p
        b_y = nvfp4_rows_dot(p_w2 + slot * stride_w2e, p_s2w + slot * stride_s2we, o_h, m_h, stride_w2r, stride_s2wr,
                             p_h, o_p, o_p >= 0, stride_ht, 0, tl.where(on, I // 8, 0), 1, BLOCK_H, BLOCK_W)
    b_wt = tl.load(p_wts + i_p).to(tl.float32) * tl.load(p_s2 + slot * stride_s2e + 2)
    o_1 = tl.arange(0, 1)
    tl.store(p_yp + i_p * stride_yp + o_1[:, None] + o_h[None, :], tl.where(on, b_y * b_wt, 0.0), mask=m_h[None, :])


@triton.jit
def moe_sum_pairs_kernel(p_yp, p_out, H, TOPK, stride_yp, stride_ot, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (T, H / BLOCK): out[t] = sum_j yp[t * TOPK + j], cast to out's dtype."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i_t = tl.program_id(0)
    o_h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m_h = o_h < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOPK):
        acc += tl.load(p_yp + (i_t * TOPK + j) * stride_yp + o_h, mask=m_h, other=0.0)
    tl.store(p_out + i_t * stride_ot + o_h, acc.to(p_out.dtype.element_ty), mask=m_h)


# (BLOCK rows, BLOCK_W words or 0 for the whole K in one tile, num_warps) of the per-pair gate_up
# and down passes, for one token and for more; the H200 sweep's best (bench/kernels_nvfp4.py
# --sweep, bench/RESULTS.md)
GATE_UP_CONFIG = {1: (8, 0, 4), 2: (8, 0, 4)}
DOWN_CONFIG = {1: (32, 32, 4), 2: (32, 0, 4)}


def moe_over_slots_triton(
    x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w, *, out: torch.Tensor | None = None,
    gate_up_config: tuple[int, int, int] | None = None, down_config: tuple[int, int, int] | None = None,
    grouped: bool | None = None, grouped_config: tuple | None = None,
    distinct_slots: int | None = None,
) -> torch.Tensor:
    """sum_k weight_k * down(silu(gate(x)) * up(x)) with NVFP4 experts read from slots.

    Args:
        x: [T, H] fp32/bf16/fp16; topk_slots: [T, k] integer slots, -1 = skip the pair;
        topk_weights: [T, k]; w: an NVFP4 `SlotWeights`; out: optional [T, H] in x's dtype.
        grouped: force the grouped (True) or per-pair (False) path; default by T
            (`GROUPED_MIN_TOKENS`). The *_config arguments override the tuned block sizes.
        distinct_slots: grouped path only: an upper bound on the distinct values in topk_slots,
            -1 included (`group_pairs`); default the pool's slot count + 1.
    Returns: [T, H] in x's dtype.
    Raises: ValueError for dense slot pools or mismatched shapes.
    """
    t, hid = x.shape
    i = _check_pool(x, topk_slots, topk_weights, w)
    k = topk_slots.shape[1]
    x = x.contiguous()
    slots = topk_slots.reshape(-1).to(torch.int32).contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    s13, s2w = w.w13_scale.contiguous().view(torch.uint8), w.w2_scale.contiguous().view(torch.uint8)
    s2 = w.scale_2.float().contiguous()
    y = torch.empty_like(x) if out is None else out
    if t == 0:
        return y
    if grouped if grouped is not None else t > GROUPED_MIN_TOKENS:
        w13, w2 = w.w13.contiguous(), w.w2.contiguous()
        step = kernel_options().moe.grouped_max_tokens
        for a in range(0, t, step):  # bounded workspace (`ft.kernels.moe.moe_workspace_bytes`)
            b = min(t, a + step)
            grouped_moe(x[a:b], slots[a * k : b * k], wts[a * k : b * k], k, w13, s13, w2, s2w, s2, y[a:b], i,
                        grouped_config or grouped_config_for(b - a), distinct_slots)
        return y
    w13, w2 = as_words(w.w13), as_words(w.w2)
    h = torch.empty((t * k, i), dtype=torch.float32, device=x.device)
    block_i, bw13, warps13 = gate_up_config or GATE_UP_CONFIG[min(t, 2)]
    block_h, bw2, warps2 = down_config or DOWN_CONFIG[min(t, 2)]
    # BLOCK_W 0: a row's whole K in one tile (when K / 8 is a power of two <= 1024), else 64 words
    whole13 = whole_k_words(hid) if bw13 == 0 else 0
    whole2 = whole_k_words(i) if bw2 == 0 else 0
    bw13 = max(2, min(bw13 or 64, triton.next_power_of_2(hid // 8)))
    bw2 = max(2, min(bw2 or 64, triton.next_power_of_2(i // 8)))
    asm = kernel_options().nvfp4.lanes_ptx and inline_ptx(x.device)  # the whole-K tiles' word decode in PTX
    _moe_gate_up_kernel[(t * k, triton.cdiv(i, block_i))](
        x, slots, w13, s13, s2, h, i, hid, k,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), s2.stride(0), h.stride(0),
        BLOCK_I=block_i, BLOCK_W=bw13, WHOLE_K=whole13, ASM=asm and whole13 > 0, num_warps=warps13,
        **pdl_args(x.device))
    y_pairs = torch.empty((t * k, hid), dtype=torch.float32, device=x.device)
    _moe_down_pairs_kernel[(t * k, triton.cdiv(hid, block_h))](
        h, slots, wts, w2, s2w, s2, y_pairs, i, hid,
        h.stride(0), w2.stride(0), w2.stride(1), s2w.stride(0), s2w.stride(1), s2.stride(0), y_pairs.stride(0),
        BLOCK_H=block_h, BLOCK_W=bw2, WHOLE_K=whole2, ASM=asm and whole2 > 0, num_warps=warps2,
        **pdl_args(x.device))
    moe_sum_pairs_kernel[(t, triton.cdiv(hid, 1024))](y_pairs, y, hid, k, y_pairs.stride(0), y.stride(0), BLOCK=1024,
                                                       **pdl_args(x.device))
    return y


def _check_pool(x: torch.Tensor, topk_slots: torch.Tensor, topk_weights: torch.Tensor, w) -> int:
    """The pool's intermediate size I; ValueError unless `w` is an NVFP4 pool of x's hidden size
    and the slots and weights are [T, k]."""
    if not w.is_nvfp4:
        raise ValueError("the Triton MoE takes NVFP4 slot pools only")
    t, hid = x.shape
    i = w.w13.shape[1] // 2
    if w.w13.shape[2] * 2 != hid or w.w2.shape[1] != hid or w.w2.shape[2] * 2 != i or i % 16 or hid % 16:
        raise ValueError(f"slot pool shapes {tuple(w.w13.shape)}, {tuple(w.w2.shape)} do not match x {tuple(x.shape)}")
    if topk_slots.shape != topk_weights.shape or topk_slots.shape[0] != t:
        raise ValueError(f"topk_slots {tuple(topk_slots.shape)} and topk_weights {tuple(topk_weights.shape)} must be [T, k]")
    return i


def moe_over_pools_triton(x: torch.Tensor, topk_weights: torch.Tensor, passes, *,
                          distinct_slots: int | None = None) -> torch.Tensor:
    """`moe_over_slots_triton`'s grouped path with the pairs' experts spread over several NVFP4 pools
    (`ft.kernels.moe.moe_over_pools`'s contract): each pass's grouped GEMMs (`grouped_pairs`, in
    token chunks of `MoeOptions.grouped_max_tokens`) fill their pairs' rows of one y_pairs [T * k, H] in x's dtype,
    enqueued before the next pass is drawn; one ordered sum over the pairs live in any pass. The same
    bits as one grouped `moe_over_slots_triton` over a pool holding every expert. distinct_slots:
    a bound on the distinct values of each pass's slots, -1 included (default: its pool's slots + 1)."""
    t, hid = x.shape
    k = topk_weights.shape[1]
    x = x.contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    y_pairs = torch.empty((t * k, hid), dtype=x.dtype, device=x.device)  # rows of pairs no pass has: never read
    live = torch.full((t * k,), -1, dtype=torch.int32, device=x.device)
    for topk_slots, w in passes:
        i = _check_pool(x, topk_slots, topk_weights, w)
        slots = topk_slots.reshape(-1).to(torch.int32).contiguous()
        if t == 0:
            continue
        s13, s2w = w.w13_scale.contiguous().view(torch.uint8), w.w2_scale.contiguous().view(torch.uint8)
        s2 = w.scale_2.float().contiguous()
        w13, w2 = w.w13.contiguous(), w.w2.contiguous()
        step = kernel_options().moe.grouped_max_tokens
        for a in range(0, t, step):
            b = min(t, a + step)
            grouped_pairs(x[a:b], slots[a * k : b * k], wts[a * k : b * k], k, w13, s13, w2, s2w, s2,
                          y_pairs[a * k : b * k], i, grouped_config_for(b - a), distinct_slots)
        torch.maximum(live, slots, out=live)
    y = torch.empty_like(x)
    return y if t == 0 else sum_live_pairs(y_pairs, live, y, k)
