"""Sparse paged decode attention (QSA, Qwen3.8-Flash-Next): one query per sequence over a list of its
token positions (the ones its indexer selected), in Triton. Details module of `ft.kernels.attention`
(whose `sparse_decode_attention` dispatches here); `reference.sparse_decode_attention_ref` is the
contract.

Split-K over the list: program (b, kv head, split) walks BLOCK_N positions at a time (the positions
of a tile need not be contiguous: each token's page comes from the page table), with the paged decode
attention's tile loader (`load_kv_tile`: bf16/fp16/fp32 as stored, fp8 and NVFP4 dequantized exactly)
and an online softmax that a tile without any position (-1 entries) leaves unchanged; the splits'
(max, sum, acc) are stored in the paged decode attention's split layout and combined, with the output
gate, by its combine kernel (`kernel.combine_splits`: one launch). Every shape is fixed by B and the
list's width, so a CUDA graph may hold it.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ft.kernels.attention.decode_loops import load_q, load_kv_tile
from ft.kernels.attention.kernel import combine_splits
from ft.kernels.options import kernel_options
from ft.kernels.attention.reference import NVFP4_CACHE as NVFP4_KV
from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

__all__ = ["sparse_decode_attention_triton"]

BLOCK_N = 32
"""Positions a tile holds (QSA's lists are blocks of 4 consecutive tokens: 8 blocks a tile)."""
TARGET_PROGRAMS = 264
"""Programs the split count aims at (two per SM of an H200); at most one split per tile."""


@triton.jit
def _sparse_decode_kernel(p_q, p_k, p_v, p_pt, p_tok, p_acc, p_st, p_kvs, p_g, p_o, W, G, D, qk_scale,
                          stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                          stride_ptb, stride_tb, stride_ar, stride_ah, stride_sr, stride_sh,
                          stride_gb, stride_gh, stride_ob, stride_oh,
                          TILES: tl.constexpr, PAGE_SIZE: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                          KV_FP8: tl.constexpr, KV_NVFP4: tl.constexpr, EVEN_D: tl.constexpr,
                          ONE_PASS: tl.constexpr = False, HAS_GATE: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (b, kv, s): the group's queries over positions [s * TILES * BLOCK_N, ...) of list b ->
    acc [B * S, Hq, D] (unnormalized), max and sum [B * S, Hq, 2] (log2 units), row b * S + s: the
    layout `_decode_combine_kernel` reads. A quantized cache's K scale (p_kvs[0]) folds into the scores,
    its V scale (p_kvs[1]) into acc.

    ONE_PASS (one split, S = 1): the program writes out [B, Hq, D] itself, acc / sum (times
    sigmoid(gate [B, Hq, D]) with HAS_GATE) rounded once to out's dtype, and nothing to acc or the
    stats: the combine's arithmetic at one split (its weight exp2(max - max) is 1), so the same bits."""
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    if KV_FP8 or KV_NVFP4:
        qk_scale = qk_scale * tl.load(p_kvs)
    i_b, i_kv, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    n_s = tl.num_programs(2)
    b_q = load_q(p_q, i_b, i_kv, G, D, stride_qb, stride_qh, BLOCK_G, BLOCK_D, EVEN_D)
    p_k += i_kv * stride_kh
    p_v += i_kv * stride_vh
    p_pt += i_b * stride_ptb
    b_m = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    b_l = tl.zeros((BLOCK_G,), dtype=tl.float32)
    b_acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for t in range(TILES):
        o_w = (i_s * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        b_tok = tl.load(p_tok + i_b * stride_tb + o_w, mask=o_w < W, other=-1).to(tl.int64)
        m_n = b_tok >= 0
        b_tok = tl.where(m_n, b_tok, 0)
        b_page = tl.load(p_pt + b_tok // PAGE_SIZE, mask=m_n, other=0).to(tl.int64)
        o_slot = b_tok % PAGE_SIZE
        b_k = load_kv_tile(p_k, b_page * stride_kp + o_slot * stride_ks, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D, KV_FP8,
                           KV_NVFP4, EVEN_D)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # a tile with no position yet: nothing moves
        b_alpha = tl.exp2(b_m - b_ref)
        b_p = tl.exp2(b_s - b_ref[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_v = load_kv_tile(p_v, b_page * stride_vp + o_slot * stride_vs, m_n, D, b_q.dtype, BLOCK_N, BLOCK_D, KV_FP8,
                           KV_NVFP4, EVEN_D)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_q.dtype), b_v, input_precision=PRECISION)
        b_m = b_m_new
    if KV_FP8 or KV_NVFP4:
        b_acc = b_acc * tl.load(p_kvs + 1)
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_gd = m_g[:, None] & (o_d < D)[None, :]
    o_h = i_kv * G + o_g
    if ONE_PASS:  # no position at all: acc 0, sum 0 -> zeros, as the combine gives
        b_out = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
        if HAS_GATE:
            b_gate = tl.load(p_g + i_b * stride_gb + o_h[:, None] * stride_gh + o_d[None, :], mask=m_gd, other=0.0)
            b_out = b_out * tl.sigmoid(b_gate.to(tl.float32))
        tl.store(p_o + i_b * stride_ob + o_h[:, None] * stride_oh + o_d[None, :], b_out.to(p_o.dtype.element_ty),
                 mask=m_gd)
    else:  # the paged decode's split layout, which its combine kernel reads: row b * S + s, query head kv * G + g
        row = i_b * n_s + i_s
        tl.store(p_acc + row * stride_ar + o_h[:, None] * stride_ah + o_d[None, :], b_acc, mask=m_gd)
        tl.store(p_st + row * stride_sr + o_h * stride_sh, b_m, mask=m_g)
        tl.store(p_st + row * stride_sr + o_h * stride_sh + 1, b_l, mask=m_g)


def sparse_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   page_table: torch.Tensor, tokens: torch.Tensor, scale: float,
                                   kv_scale: torch.Tensor | None = None, splits: int | None = None, *,
                                   gate: torch.Tensor | None = None) -> torch.Tensor:
    """As `sparse_decode_attention_ref` (its argument contract); `splits`: force a split count. Two
    launches: the splits, then the paged decode's combine kernel (which also applies `gate`); one where
    the count is 1 (a prefill's rows; `QsaOptions.one_pass`, the tile `QsaOptions.one_split_tile`, or
    `one_split_tile_quantized` on an fp8 or NVFP4 cache)."""
    b, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"sparse_decode_attention: {hq} query heads over {hkv} kv heads")
    if tokens.dim() != 2 or tokens.shape[0] != b:
        raise ValueError(f"sparse_decode_attention: tokens must be [B={b}, W], got {tuple(tokens.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("sparse_decode_attention: the last dim of q and of the caches must be contiguous")
    if gate is not None:
        if gate.shape != q.shape or gate.dtype != q.dtype:
            raise ValueError(f"sparse_decode_attention: gate must be {tuple(q.shape)} {q.dtype}, got "
                             f"{tuple(gate.shape)} {gate.dtype}")
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    g, w = hq // hkv, tokens.shape[1]
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if not b:
        return out
    if not w:  # no position: zeros (gated zeros are zeros)
        return out.zero_()
    block_g, block_d = max(16, triton.next_power_of_2(g)), max(16, triton.next_power_of_2(d))
    block_n, warps, stages = BLOCK_N, 4, 3
    tiles = max(1, triton.cdiv(w, block_n))
    if splits is None:
        splits = max(1, min(tiles, TARGET_PROGRAMS // max(1, b * hkv)))
    opts = kernel_options().qsa
    if splits == 1:  # (a prefill's rows: one program walks a whole list)
        quantized = k_cache.dtype in (NVFP4_KV, torch.float8_e4m3fn)
        block_n, warps, stages = opts.one_split_tile_quantized if quantized else opts.one_split_tile
        tiles = max(1, triton.cdiv(w, block_n))
    per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, per_split)
    one_pass = splits == 1 and opts.one_pass
    if one_pass:  # (the kernel writes out: no partials)
        acc = st = out
    else:
        acc = torch.empty(b * splits, hq, d, dtype=torch.float32, device=q.device)
        st = torch.empty(b * splits, hq, 2, dtype=torch.float32, device=q.device)
    nvfp4, fp8 = k_cache.dtype == NVFP4_KV, k_cache.dtype == torch.float8_e4m3fn
    kc, vc = k_cache, v_cache
    if fp8 or nvfp4:  # the tiles come exact without the layer scale: K's folds into the scores, V's into acc
        if kv_scale is None:
            raise ValueError("sparse_decode_attention: a quantized KV cache needs kv_scale")
        if fp8:
            kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    # NOTE: without a gate, out stands in for its pointer, never read (HAS_GATE prunes the load)
    gp, g_strides = (gate, (gate.stride(0), gate.stride(1))) if gate is not None else (out, (0, 0))
    _sparse_decode_kernel[(b, hkv, splits)](
        q, kc, vc, page_table, tokens, acc, st, kv_scale if kv_scale is not None else out, gp, out, w, g, d,
        scale * math.log2(math.e), q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        page_table.stride(0), tokens.stride(0), acc.stride(0), acc.stride(1), st.stride(0), st.stride(1),
        *g_strides, out.stride(0), out.stride(1),
        TILES=per_split, PAGE_SIZE=page, BLOCK_G=block_g, BLOCK_N=block_n,
        BLOCK_D=block_d, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=fp8, KV_NVFP4=nvfp4,
        EVEN_D=d == block_d, ONE_PASS=one_pass, HAS_GATE=one_pass and gate is not None, num_warps=warps,
        num_stages=stages, **pdl_args(q.device))
    if not one_pass:
        combine_splits(acc, st, gate, out, splits, min(block_d, kernel_options().decode_attention.combine_block_d))
    return out
