"""Attention over a paged KV cache: torch reference.

KV layout (one full-attention layer): k_cache, v_cache [P, page_size, Hkv, D]; a sequence's
page table lists its pages in order, so token position p lives at
(page_table[p // page_size], p % page_size).

Quantized KV (`kv_scale` given: float32 [2], the layer's K and V scales): the cache holds
x / scale in its dtype (float8_e4m3fn: rounded to nearest even after clamping to +-448, the
format's largest finite value); a read gives cache * scale. Without `kv_scale` the cache holds x
in its dtype.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x -> what the cache stores: x / scale clamped into the format's range, in `dtype`; x in
    `dtype` when scale is None."""
    if scale is None:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(c: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """What the cache stores -> values in `dtype` (cache * scale, computed in float32)."""
    return c.to(dtype) if scale is None else (c.float() * scale).to(dtype)


def write_kv_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_table: torch.Tensor,
    start: int,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v [T, Hkv, D] of positions start .. start+T-1 into the pages (quantized with
    `kv_scale` when given, see the module docstring)."""
    page = k_cache.shape[1]
    pos = torch.arange(start, start + k.shape[0], device=k.device)
    pages = page_table[pos // page]
    ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k_cache[pages, pos % page] = quantize_kv(k, ks, k_cache.dtype)
    v_cache[pages, pos % page] = quantize_kv(v, vs, v_cache.dtype)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    start: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries at positions start .. start+T-1 over keys 0 .. start+T-1
    (`kv_scale`: the cache is quantized, see the module docstring).

    Args:
        q: [T, Hq, D]; Hq a multiple of Hkv (query head h reads kv head h // (Hq // Hkv)).
        page_table: [n] int64 page ids covering at least start+T positions.
    Returns: [T, Hq, D] in q's dtype (softmax in float32).
    """
    t, hq, _ = q.shape
    n_ctx = start + t
    page = k_cache.shape[1]
    pos = torch.arange(n_ctx, device=q.device)
    pages = page_table[pos // page]
    k = k_cache[pages, pos % page]  # [N, Hkv, D]
    v = v_cache[pages, pos % page]
    rep = hq // k.shape[1]
    ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k = dequantize_kv(k.repeat_interleave(rep, dim=1), ks, q.dtype)
    v = dequantize_kv(v.repeat_interleave(rep, dim=1), vs, q.dtype)
    scores = torch.einsum("thd,nhd->htn", q, k) * scale
    q_pos = torch.arange(start, n_ctx, device=q.device)
    mask = pos[None, :] > q_pos[:, None]  # [T, N]: future keys
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("htn,nhd->thd", probs, v)


def write_kv_decode_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Store one new token per sequence: k, v [B, Hkv, D] at slots slot_mapping [B] int64
    (slot = page * page_size + offset); a negative slot (a padding row) writes nothing."""
    page = k_cache.shape[1]
    keep = (slot_mapping >= 0).nonzero().flatten()
    slots = slot_mapping[keep]
    ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k_cache[slots // page, slots % page] = quantize_kv(k[keep], ks, k_cache.dtype)
    v_cache[slots // page, slots % page] = quantize_kv(v[keep], vs, v_cache.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    gate: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, at position seq_lens[b] - 1, over keys 0 .. seq_lens[b] - 1
    (`kv_scale`: the cache is quantized, see the module docstring).

    Args:
        q: [B, Hq, D]; Hq a multiple of Hkv (query head h reads kv head h // (Hq // Hkv)).
        k_cache, v_cache: [P, page_size, Hkv, D].
        page_table: [B, max_pages] int64; row b lists sequence b's pages, entries past its length
            are never read (they may hold anything).
        seq_lens: [B] int32/int64; 0 (a padding row) gives zeros (times the gate: zeros for a finite gate).
        gate: optional output gate [B, Hq, D] (any strides), e.g. Qwen3-Next's gated attention: the
            result is then o * sigmoid(gate), both in float32, cast to q's dtype once.
    Returns: [B, Hq, D] in q's dtype (scores, softmax and sums in float32).
    """
    b, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    longest = int(seq_lens.max()) if b else 0  # NOTE: a host sync; the Triton path has none
    pos = torch.arange(-(-longest // page) * page, device=q.device)
    valid = pos[None, :] < seq_lens[:, None].long()  # [B, N]
    pages = page_table[:, pos // page].masked_fill(~valid, 0)  # NOTE: garbage entries never index
    ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k = dequantize_kv(k_cache[pages, pos % page], ks, torch.float32).masked_fill(~valid[..., None, None], 0.0)
    v = dequantize_kv(v_cache[pages, pos % page], vs, torch.float32).masked_fill(~valid[..., None, None], 0.0)
    qg = q.float().reshape(b, hkv, hq // hkv, d)
    scores = torch.einsum("bkgd,bnkd->bkgn", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows of padding sequences: all -inf
    o = torch.einsum("bkgn,bnkd->bkgd", probs, v).reshape(b, hq, d)
    if gate is not None:  # NOTE: on the float32 output, so the gated result is rounded once, as the kernels round it
        o = o * torch.sigmoid(gate.float())
    return o.to(q.dtype)
