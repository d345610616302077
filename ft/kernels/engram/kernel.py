"""Qwen3.8-Flash-Next's decode-step Engram in three Triton launches (`reference.py` is the contract),
where the batched torch forms take ~130 small ones:

* `_ngram_rows_kernel`: program b hashes row b's n-grams (its token and its slot's context) into its
  table rows, and writes the context moved on back to the slot.
* `_ple_gate_kernel`: program b, stream by stream: the key's and the streams' grouped RMSNorms, their
  dot, the signed square root and sigmoid, the gated value u and u_hat = norm_conv(u).
* `_ple_conv_kernel`: program (b, block of columns): the dilated causal conv of u_hat over the slot's
  history, x + u + silu(conv), and the history moved on by one row (oldest out, u_hat in).

A prefill's packed tokens (`ple_prefill_triton`) take the same gate kernel, a token a row, then
`_ple_conv_prefill_kernel`: program (t, block of columns): each tap from an earlier token of the batch or
from the sequence's history, x + u + silu(conv); the new histories are a gather in torch. Where the
model's torch form held ~205 KiB a token of fp32 temporaries (3.3 GiB at 16K tokens), this holds the
key/value projection, u and u_hat (~67 KiB a token at Flash-Next's geometry).

A negative slot (a CUDA graph's padding row) reads an empty state and writes nothing; every shape is
fixed by the batch, so a graph holds them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

BLOCK_COLUMNS = 1024
"""Columns of a conv program (4 warps, 8 a thread: each column belongs to one thread, so the history's
shift, a load of row r + 1 then a store to row r, is ordered by the thread's own program order)."""


@triton.jit
def _ngram_rows_kernel(p_ids, p_ctx, p_slots, p_sizes, p_offsets, p_rows, stride_ctx, EOS, M0, M1, M2, M3,
                       C: tl.constexpr, HEADS_PER: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(p_slots + i).to(tl.int64)
    live = slot >= 0
    base = p_ctx + tl.where(live, slot, 0) * stride_ctx
    o_k = tl.arange(0, BLOCK_H)
    m_k = o_k < C * HEADS_PER
    order = o_k // HEADS_PER + 1  # head k hashes shifts 0 .. order (its n-gram of order + 1)
    tok = tl.load(p_ids + i).to(tl.int64)
    mix = tok * M0
    heads = tl.zeros((BLOCK_H,), dtype=tl.int64)
    cut = tok != tok  # (False)
    prev = tok
    for s in tl.static_range(1, C + 1):
        stored = tl.load(base + C - s)
        stored = tl.where(live, stored, 0)
        raw = tl.where(stored == 0, EOS, stored - 1)  # token s back
        token = raw
        if s >= 2:
            cut = cut | (prev == EOS)
            token = tl.where(cut, EOS, raw)
        if s == 1:
            mult = M1
        elif s == 2:
            mult = M2
        else:
            mult = M3
        mix = mix ^ (token * mult)
        heads = tl.where(order == s, mix, heads)
        # the context moved on: the token s - 1 back lands at c - s (oldest first; read above, stored now)
        tl.store(base + C - s, (tok if s == 1 else prev) + 1, mask=live)
        prev = raw
    size = tl.load(p_sizes + o_k, mask=m_k, other=1)
    r = heads % size
    r = tl.where(r < 0, r + size, r)  # (C's remainder keeps the dividend's sign; the hash's does not)
    tl.store(p_rows + i * (C * HEADS_PER) + o_k, r + tl.load(p_offsets + o_k, mask=m_k, other=0), mask=m_k)


def ngram_rows_decode_triton(ids: torch.Tensor, contexts: torch.Tensor, slots: torch.Tensor,
                             multipliers: tuple[int, ...], sizes: torch.Tensor, offsets: torch.Tensor,
                             heads_per_ngram: int, eos: int) -> torch.Tensor:
    """As `ngram_rows_decode_ref` (n-grams of up to 4 tokens). Raises ValueError past that or for a
    context pool that is not [S, c] int64 with unit column stride."""
    b, c = ids.shape[0], contexts.shape[1]
    if not 1 <= c <= 3 or len(multipliers) < c + 1:
        raise ValueError(f"ngram rows: contexts of {c} ids with {len(multipliers)} multipliers (n-grams up to 4)")
    if contexts.dtype != torch.int64 or contexts.stride(1) != 1:
        raise ValueError(f"ngram rows: contexts must be [S, c] int64 with unit column stride, got {contexts.dtype} "
                         f"strides {contexts.stride()}")
    heads = c * heads_per_ngram
    if sizes.shape != (heads,) or offsets.shape != (heads,):
        raise ValueError(f"ngram rows: {heads} heads, sizes {tuple(sizes.shape)}, offsets {tuple(offsets.shape)}")
    rows = torch.empty(b, heads, dtype=torch.int64, device=ids.device)
    if b:
        m = list(multipliers[: c + 1]) + [0] * (3 - c)
        _ngram_rows_kernel[(b,)](ids, contexts, slots, sizes, offsets, rows, contexts.stride(0), eos, *m, C=c,
                                 HEADS_PER=heads_per_ngram, BLOCK_H=triton.next_power_of_2(heads), num_warps=1, **pdl_args(ids.device))
    return rows


@triton.jit
def _rms(v, m, D, eps):
    return tl.where(m, v / tl.sqrt(tl.sum(v * v, axis=0) / D + eps), 0.0)


@triton.jit
def _ple_gate_kernel(p_x, p_kv, p_nk, p_nq, p_nc, p_u, p_uh, D, eps, inv_sqrt_d, stride_x, stride_kv, stride_u,
                     C: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    # program (i, h): row i's stream h (the streams' gates are independent: C programs, not one program's
    # C dependent rounds of four reductions each, 13.7 us a call at Flash-Next's 4 x 2,560 in one program)
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    o = tl.arange(0, BLOCK_D)
    m = o < D
    value = tl.load(p_kv + i * stride_kv + C * D + o, mask=m, other=0.0).to(tl.float32)
    col = h * D + o
    key = _rms(tl.load(p_kv + i * stride_kv + col, mask=m, other=0.0).to(tl.float32), m, D, eps)
    key = key * (1.0 + tl.load(p_nk + col, mask=m, other=0.0).to(tl.float32))
    query = _rms(tl.load(p_x + i * stride_x + col, mask=m, other=0.0).to(tl.float32), m, D, eps)
    query = query * (1.0 + tl.load(p_nq + col, mask=m, other=0.0).to(tl.float32))
    g = tl.sum(key * query, axis=0) * inv_sqrt_d
    root = tl.sqrt(tl.maximum(tl.abs(g), 1e-6))
    g = tl.where(g > 0, root, tl.where(g < 0, -root, 0.0))  # sign(g) sqrt(max(|g|, 1e-6))
    u = (1.0 / (1.0 + tl.exp(-g))) * value
    u = u.to(p_u.dtype.element_ty).to(tl.float32)  # (rounded as stored: the norm reads what the conv adds)
    uh = _rms(u, m, D, eps) * (1.0 + tl.load(p_nc + col, mask=m, other=0.0).to(tl.float32))
    tl.store(p_u + i * stride_u + col, u.to(p_u.dtype.element_ty), mask=m)
    tl.store(p_uh + i * stride_u + col, uh.to(p_uh.dtype.element_ty), mask=m)


@triton.jit
def _ple_write(acc, p_x, p_u, p_out, i, o, m, stride_x, stride_u, stride_o):
    """Row i's columns o of out = x + (u + silu(conv)), from the conv's fp32 sum acc, rounded where the reference
    rounds: the conv and the SiLU's output to out's dtype, then their sum with u, then x + delta."""
    acc = acc.to(p_out.dtype.element_ty).to(tl.float32)
    silu = (acc / (1.0 + tl.exp(-acc))).to(p_out.dtype.element_ty).to(tl.float32)
    u = tl.load(p_u + i * stride_u + o, mask=m, other=0.0).to(tl.float32)
    delta = (u + silu).to(p_out.dtype.element_ty)
    x = tl.load(p_x + i * stride_x + o, mask=m, other=0.0)
    tl.store(p_out + i * stride_o + o, x + delta, mask=m)


@triton.jit
def _ple_conv_kernel(p_x, p_u, p_uh, p_hist, p_slots, p_w, p_out, W, stride_x, stride_u, stride_hs, stride_hr,
                     stride_w, stride_o, K: tl.constexpr, DIL: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < W
    slot = tl.load(p_slots + i).to(tl.int64) + tl.zeros_like(o)
    live = m & (slot >= 0)
    hist = p_hist + tl.where(live, slot, 0) * stride_hs
    uh = tl.load(p_uh + i * stride_u + o, mask=m, other=0.0)
    acc = uh.to(tl.float32) * tl.load(p_w + o * stride_w + K - 1, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):
        tap = tl.load(hist + (j * DIL) * stride_hr + o, mask=live, other=0.0).to(tl.float32)
        acc += tap * tl.load(p_w + o * stride_w + j, mask=m, other=0.0).to(tl.float32)
    _ple_write(acc, p_x, p_u, p_out, i, o, m, stride_x, stride_u, stride_o)
    for r in tl.static_range((K - 1) * DIL - 1):  # the history moved on: row r takes row r + 1
        tl.store(hist + r * stride_hr + o, tl.load(hist + (r + 1) * stride_hr + o, mask=live), mask=live)
    tl.store(hist + ((K - 1) * DIL - 1) * stride_hr + o, uh.to(p_hist.dtype.element_ty), mask=live)


@triton.jit
def _ple_conv_prefill_kernel(p_x, p_u, p_uh, p_hist, p_seq, p_local, p_w, p_out, W, stride_x, stride_u, stride_hb,
                             stride_hr, stride_w, stride_o, K: tl.constexpr, DIL: tl.constexpr, BLOCK: tl.constexpr,
                             PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < W
    seq = tl.load(p_seq + i).to(tl.int64)
    local = tl.load(p_local + i).to(tl.int64)  # the token's index in its sequence
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads the token (K - 1 - j) * DIL back, in the reference's order
        back = (K - 1 - j) * DIL
        p = local - back + tl.zeros_like(o)  # its index in the sequence: < 0 is row (K - 1) * DIL + p of the history
        inside = p >= 0
        from_batch = tl.load(p_uh + (i - back) * stride_u + o, mask=m & inside, other=0.0)
        from_hist = tl.load(p_hist + seq * stride_hb + ((K - 1) * DIL + p) * stride_hr + o, mask=m & (p < 0),
                            other=0.0)
        tap = tl.where(inside, from_batch.to(tl.float32), from_hist.to(tl.float32))
        acc += tap * tl.load(p_w + o * stride_w + j, mask=m, other=0.0).to(tl.float32)
    _ple_write(acc, p_x, p_u, p_out, i, o, m, stride_x, stride_u, stride_o)


def _check_ple(name: str, x: torch.Tensor, key_value: torch.Tensor, conv: torch.Tensor, histories: torch.Tensor,
               streams: int, dilation: int) -> tuple[int, int, int, int]:
    """(rows, C*D, D, K) after the shape checks that `ple_decode_triton` and `ple_prefill_triton` share."""
    b, width = x.shape
    d = width // streams
    k = conv.shape[-1]
    hist = (k - 1) * dilation
    if width != streams * d or key_value.shape != (b, width + d) or conv.shape != (width, k) or k < 2:
        raise ValueError(f"{name}: x {tuple(x.shape)}, key_value {tuple(key_value.shape)}, conv "
                         f"{tuple(conv.shape)} for {streams} streams")
    if histories.shape[1:] != (hist, width) or histories.stride(2) != 1:
        raise ValueError(f"{name}: histories {tuple(histories.shape)} must be [S, {hist}, {width}], rows contiguous")
    for label, t in (("x", x), ("key_value", key_value)):
        if t.stride(1) != 1:
            raise ValueError(f"{name}: {label} must have unit column stride")
    return b, width, d, k


def _ple_gate(x: torch.Tensor, key_value: torch.Tensor, norm_key: torch.Tensor, norm_query: torch.Tensor,
              norm_conv: torch.Tensor, streams: int, d: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, u_hat) [rows, C*D] of every row, one `_ple_gate_kernel` program a row and stream."""
    u = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    u_hat = torch.empty_like(u)
    block_d = triton.next_power_of_2(d)
    _ple_gate_kernel[(x.shape[0], streams)](x, key_value, norm_key, norm_query, norm_conv, u, u_hat, d, eps,
                                            1.0 / math.sqrt(d), x.stride(0), key_value.stride(0), u.stride(0),
                                            C=streams, BLOCK_D=block_d, num_warps=max(1, min(8, block_d // 256)),
                                            **pdl_args(x.device))
    return u, u_hat


def ple_prefill_triton(x: torch.Tensor, key_value: torch.Tensor, histories: torch.Tensor, cu_seqlens: torch.Tensor,
                       norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, conv: torch.Tensor,
                       streams: int, dilation: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As `ple_prefill_ref`: two launches (the gate, the conv) and a torch gather for the new histories.
    Raises ValueError for shapes that do not match or rows without unit column stride."""
    t, width, d, k = _check_ple("ple prefill", x, key_value, conv, histories, streams, dilation)
    hist = (k - 1) * dilation
    b = histories.shape[0]
    if cu_seqlens.shape != (b + 1,):
        raise ValueError(f"ple prefill: cu_seqlens {tuple(cu_seqlens.shape)} for {b} histories")
    out = torch.empty_like(x)
    if not t:
        return out, histories.clone()
    u, u_hat = _ple_gate(x, key_value, norm_key, norm_query, norm_conv, streams, d, eps)
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    positions = torch.arange(t, device=x.device)
    seq = torch.searchsorted(cu[1:], positions, right=True)
    local = positions - cu[seq]
    block = min(BLOCK_COLUMNS, triton.next_power_of_2(width))
    _ple_conv_prefill_kernel[(t, triton.cdiv(width, block))](
        x, u, u_hat, histories, seq, local, conv, out, width, x.stride(0), u.stride(0), histories.stride(0),
        histories.stride(1), conv.stride(0), out.stride(0), K=k, DIL=dilation, BLOCK=block,
        num_warps=max(1, min(4, block // 256)), **pdl_args(x.device))
    # each sequence's last `hist` conv inputs, oldest first: from its tokens, or (a short one) its old history
    back = (cu[1:] - cu[:-1])[:, None] - hist + torch.arange(hist, device=x.device)[None, :]  # [B, hist]
    from_batch = u_hat[(cu[:-1, None] + back).clamp(min=0)]
    from_hist = histories[torch.arange(b, device=x.device)[:, None], (hist + back).clamp(max=hist - 1)]
    return out, torch.where((back >= 0)[:, :, None], from_batch, from_hist.to(u_hat.dtype)).to(histories.dtype)


def ple_decode_triton(x: torch.Tensor, key_value: torch.Tensor, histories: torch.Tensor, slots: torch.Tensor,
                      norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, conv: torch.Tensor,
                      streams: int, dilation: int, eps: float) -> torch.Tensor:
    """As `ple_decode_ref`: two launches. Raises ValueError for shapes that do not match or rows
    without unit column stride."""
    b, width, d, k = _check_ple("ple decode", x, key_value, conv, histories, streams, dilation)
    out = torch.empty_like(x)
    if not b:
        return out
    u, u_hat = _ple_gate(x, key_value, norm_key, norm_query, norm_conv, streams, d, eps)
    block = min(BLOCK_COLUMNS, triton.next_power_of_2(width))
    _ple_conv_kernel[(b, triton.cdiv(width, block))](
        x, u, u_hat, histories, slots, conv, out, width, x.stride(0), u.stride(0), histories.stride(0),
        histories.stride(1), conv.stride(0), out.stride(0), K=k, DIL=dilation, BLOCK=block,
        num_warps=max(1, min(4, block // 256)), **pdl_args(x.device))
    return out
