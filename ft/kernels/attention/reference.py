"""Attention over a paged KV cache: torch reference.

KV layout (one full-attention layer): k_cache, v_cache [P, page_size, Hkv, R] with R = D (the
head dim) except for NVFP4; a sequence's page table lists its pages in order, so token position
p lives at (page_table[p // page_size], p % page_size).

Quantized KV (`kv_scale` given: float32 [2], the layer's K and V scales, s below):

* float8_e4m3fn cache: holds x / s rounded to nearest even after clamping to +-448 (the format's
  largest finite value); a read gives cache * s.
* NVFP4 cache (dtype uint8, R = D/2 + D/16, D % 16 == 0): a row holds the E2M1 codes of D values
  in bytes [0, D/2) (element 2j in the low nibble of byte j; code bit 3 the sign, bits 0..2 the
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6) and D/16 float8_e4m3fn block scales (as bits) in bytes
  [D/2, D/2 + D/16), one per 16 consecutive elements. ModelOpt's NVFP4 rounding (as
  `ft.tools.nvfp4_quantize`, with s in the role of its ``scale_2``), all in float32:
  ``b = amax(|x_block|) / (6 * s)``; ``b = 1`` where it is 0; ``b`` clamped to [2**-9, 448] and
  rounded to e4m3 (nearest, ties to even); ``y = x / (b * s)`` (the product rounded first);
  the code of y is the nearest E2M1 value, ties to the even code (|y| = 0.25, 0.75, 1.25, 1.75,
  2.5, 3.5, 5 go to 0, 1, 1, 2, 2, 4, 4), above 5 gives 6 (saturates), the sign bit set iff
  y < 0. A read gives e2m1(code) * (b * s) (the scales' product rounded to float32 first).

Without `kv_scale` the cache holds x in its dtype (an NVFP4 cache always needs it).
"""

from __future__ import annotations

import torch

from ft.kernels.nvfp4.reference import BLOCK_SIZE, E2M1_MAX, E4M3_MAX, dequantize_nvfp4_rows

FP8_MAX = 448.0

NVFP4_CACHE = torch.uint8
"""The dtype of an NVFP4 cache (`ft.memory.kv_pool.NVFP4_KV`)."""

_E4M3_MIN = 2.0**-9  # smallest positive float8_e4m3fn (subnormal): the least block scale
# (bound, tie rounds up): |y| passes bound b when |y| > b, or |y| >= b where the value above b has the even code
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def nvfp4_row_size(head_dim: int) -> int:
    """Bytes per token and kv head of an NVFP4 cache: D/2 codes + D/16 block scales (D % 16 == 0)."""
    if head_dim % BLOCK_SIZE:
        raise ValueError(f"an NVFP4 KV cache needs a head dim multiple of {BLOCK_SIZE}, got {head_dim}")
    return head_dim // 2 + head_dim // BLOCK_SIZE


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head dim D of a cache [..., R]: R, or R * 16 / 9 for an NVFP4 (uint8) cache.

    Raises: ValueError for a uint8 row that is no NVFP4 row (R not a multiple of 9)."""
    r = cache.shape[-1]
    if cache.dtype != NVFP4_CACHE:
        return r
    if r % 9:
        raise ValueError(f"a uint8 (NVFP4) KV cache row has D/2 + D/16 bytes (a multiple of 9), got {r}")
    return r // 9 * 16


def _e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """float32 y (already divided by its scales) -> uint8 E2M1 codes 0..15 (module docstring's rule;
    NaN gives 0, as in the Triton write kernel)."""
    mag = y.abs()
    codes = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for bound, tie_up in _E2M1_STEPS:
        codes += ((mag >= bound) if tie_up else (mag > bound)).to(torch.uint8)
    return codes | ((y < 0).to(torch.uint8) << 3)


def quantize_nvfp4_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype, D % 16 == 0) and the layer scale (float32, one element) -> the
    NVFP4 rows uint8 [..., D/2 + D/16] (module docstring: codes, then the e4m3 block scales' bits)."""
    *lead, d = x.shape
    nvfp4_row_size(d)
    s = scale.float().reshape(())
    blocks = x.float().reshape(*lead, d // BLOCK_SIZE, BLOCK_SIZE)
    b = blocks.abs().amax(dim=-1) / (E2M1_MAX * s)
    b = torch.where(b == 0, torch.ones_like(b), b).clamp(_E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
    y = blocks / (b.float() * s).unsqueeze(-1)  # the product rounded to float32 before the division
    codes = _e2m1_codes(y).reshape(*lead, d)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat([packed, b.view(torch.uint8)], dim=-1)


def dequantize_nvfp4_kv(c: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """NVFP4 rows uint8 [..., D/2 + D/16] and the layer scale -> values [..., D] in `dtype`
    (e2m1 * (block scale * scale) in float32, then cast)."""
    d = cache_head_dim(c)
    lead = c.shape[:-1]
    packed = c[..., : d // 2].reshape(-1, 1, d // 2)
    blocks = c[..., d // 2:].reshape(-1, 1, d // BLOCK_SIZE).view(torch.float8_e4m3fn)
    rows = scale.float().reshape(1, 1).expand(packed.shape[0], 1)
    return dequantize_nvfp4_rows(packed, blocks, rows, dtype).reshape(*lead, d)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [..., D] -> what a cache of `dtype` stores (module docstring): x / scale clamped into the
    format's range, in `dtype`; NVFP4 rows [..., D/2 + D/16] for uint8; x in `dtype` when scale is
    None (not for NVFP4: ValueError)."""
    if dtype == NVFP4_CACHE:
        if scale is None:
            raise ValueError("an NVFP4 KV cache needs kv_scale (the layer's K and V scales)")
        return quantize_nvfp4_kv(x, scale)
    if scale is None:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(c: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """What the cache stores -> values in `dtype` (cache * scale, computed in float32; NVFP4 rows
    [..., D/2 + D/16] -> [..., D], which needs the scale)."""
    if c.dtype == NVFP4_CACHE:
        if scale is None:
            raise ValueError("an NVFP4 KV cache needs kv_scale (the layer's K and V scales)")
        return dequantize_nvfp4_kv(c, scale, dtype)
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


def paged_attention_lse_ref(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor, start: int, scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The log-sum-exp (natural log) over visible keys of each query's scaled scores in
    `paged_attention_ref`'s causal attention (same arguments): float32 [Hq, T], computed in float32
    from the dequantized cache. What a part of an attention split over keys carries to its merge."""
    t, hq, _ = q.shape
    n_ctx = start + t
    page = k_cache.shape[1]
    pos = torch.arange(n_ctx, device=q.device)
    k = k_cache[page_table[pos // page], pos % page]
    k = dequantize_kv(k.repeat_interleave(hq // k.shape[1], dim=1), None if kv_scale is None else kv_scale[0],
                      torch.float32)
    scores = torch.einsum("thd,nhd->htn", q.float(), k) * scale
    future = pos[None, :] > torch.arange(start, n_ctx, device=q.device)[:, None]
    return torch.logsumexp(scores.masked_fill(future[None], float("-inf")), dim=-1)


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


def sparse_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    tokens: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    *,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence over a list of its positions (QSA's selected tokens).

    Args:
        q: [B, Hq, D]; Hq a multiple of Hkv (query head h reads kv head h // (Hq // Hkv)).
        k_cache, v_cache: [P, page_size, Hkv, R] (see the module docstring; `kv_scale` for a quantized one).
        page_table: [B, max_pages] int64: row b lists sequence b's pages.
        tokens: [B, W] int64 positions into sequence b (-1: unused), in any order.
        gate: optional output gate [B, Hq, D] (any strides): the result is then o * sigmoid(gate), both in
            float32, cast to q's dtype once (as `paged_decode_attention_ref`).
    Returns: [B, Hq, D] in q's dtype (scores, softmax and sums in float32); a row with no position gives zeros.
    """
    b, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    valid = tokens >= 0
    pos = tokens.clamp(min=0)
    pages = page_table.gather(1, pos // page)  # [B, W]
    ks, vs = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
    k = dequantize_kv(k_cache[pages, pos % page], ks, torch.float32)  # [B, W, Hkv, D]
    v = dequantize_kv(v_cache[pages, pos % page], vs, torch.float32)
    qg = q.float().reshape(b, hkv, hq // hkv, d)
    scores = torch.einsum("bgrd,bwgd->bgrw", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # a row with no position: zeros
    o = torch.einsum("bgrw,bwgd->bgrd", probs, v).reshape(b, hq, d)
    if gate is not None:  # NOTE: on the float32 output, so the gated result is rounded once, as the kernels round it
        o = o * torch.sigmoid(gate.float())
    return o.to(q.dtype)
