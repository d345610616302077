"""Torch references of Qwen3.8-Flash-Next's decode-step Engram kernels (`ft.kernels.engram`): one new
token per row, each row's state at its mamba slot (-1: a padding row, which reads an empty state and
writes nothing). The model's batched torch forms (`ft.model.layers.engram`) are checked against these
in tests/test_kernels_engram_triton.py."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ft.kernels.hyper_connection.reference import grouped_rms_norm_ref
from ft.kernels.slot_write.reference import write_slots_ref


def _state_rows(pool: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pool's rows at slots (zeros where a slot is negative) and the mask of live rows."""
    live = slots >= 0
    rows = pool[slots.clamp(min=0)]
    return torch.where(live.reshape(-1, *[1] * (rows.dim() - 1)), rows, torch.zeros_like(rows)), live


def ngram_rows_decode_ref(ids: torch.Tensor, contexts: torch.Tensor, slots: torch.Tensor, multipliers: tuple[int, ...],
                          sizes: torch.Tensor, offsets: torch.Tensor, heads_per_ngram: int, eos: int) -> torch.Tensor:
    """The n-gram table rows of one new token per row, and each row's context moved on.

    Args:
        ids: [B] int64 the new tokens. contexts: [S, c] int64 the mamba pool's n-gram contexts (c = the
            n-gram size - 1; ids + 1, oldest first, 0: none, read as the EOS id). slots: [B] (-1: none).
        multipliers: the hash's int64 multipliers (index s multiplies the token s back); sizes, offsets:
            [H] int64 the heads' primes and first rows, H = c * heads_per_ngram (order 2's heads first).
    Returns:
        rows [B, H] int64: head k of order o = k // heads_per_ngram + 2 hashes the XOR of token s back
        times multipliers[s] for s < o (a token past an EOS strictly between it and the new one is the
        EOS id), modulo sizes[k] (non-negative), plus offsets[k]. contexts[slot] becomes the row's last
        c ids + 1 (written for slots >= 0 only)."""
    c = contexts.shape[1]
    stored, _ = _state_rows(contexts, slots)
    ctx = torch.where(stored == 0, eos, stored - 1)  # [B, c] oldest first
    window = [ids.to(torch.int64)] + [ctx[:, c - s] for s in range(1, c + 1)]  # shift s back
    cut = torch.zeros_like(window[0], dtype=torch.bool)
    mix, mixes = window[0] * multipliers[0], []
    for s in range(1, c + 1):
        token = window[s]
        if s >= 2:
            cut = cut | (window[s - 1] == eos)
            token = torch.where(cut, eos, token)
        mix = mix ^ (token * multipliers[s])
        mixes.append(mix)
    per_head = torch.stack([m for m in mixes for _ in range(heads_per_ngram)], dim=1)
    rows = torch.remainder(per_head, sizes) + offsets
    after = torch.stack([window[s] for s in range(c - 1, -1, -1)], dim=1)  # the last c ids, oldest first
    write_slots_ref(contexts, slots, after + 1)
    return rows


def ple_decode_ref(x: torch.Tensor, key_value: torch.Tensor, histories: torch.Tensor, slots: torch.Tensor,
                   norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, conv: torch.Tensor,
                   streams: int, dilation: int, eps: float) -> torch.Tensor:
    """The PLE layer's decode step: x [B, C*D] (the HyperConnection streams) plus each row's delta.

    Args:
        key_value: [B, C*D + D] the key projection (C*D) then the value projection (D) of the rows'
            concatenated table rows. histories: [S, hist, C*D] the conv inputs of each slot's previous
            hist tokens (hist = (K - 1) * dilation, oldest first). slots: [B] (-1: none, an empty history).
        norm_key, norm_query, norm_conv: [C*D] grouped RMSNorm weights (1 + w); conv: [C*D, K].
    Returns:
        x + delta [B, C*D] in x's dtype, `ft.model.layers.engram.ple_delta` of one token: per stream h a
        gate sigmoid(ssqrt(<norm_key(key)_h, norm_query(x)_h> / sqrt(D))) scales the value, u the gated
        values, u_hat = norm_conv(u), delta = u + silu(the dilated causal conv of u_hat over the history).
        histories[slot] moves on by one (its oldest row out, u_hat in) for slots >= 0."""
    b, width = x.shape
    c = streams
    d = width // c
    key = grouped_rms_norm_ref(key_value[:, :width], norm_key, c, eps).reshape(b, c, d)
    query = grouped_rms_norm_ref(x, norm_query, c, eps).reshape(b, c, d)
    value = key_value[:, width:]
    g = (key * query).sum(-1) / math.sqrt(d)
    g = torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6))
    u = (torch.sigmoid(g)[:, :, None] * value[:, None, :]).reshape(b, width)
    u_hat = grouped_rms_norm_ref(u, norm_conv, c, eps)
    hist, _ = _state_rows(histories, slots)
    seq = torch.cat([hist.to(u_hat.dtype), u_hat[:, None]], dim=1)  # [B, hist + 1, C*D]
    k = conv.shape[-1]
    out = sum(seq[:, j * dilation].float() * conv[:, j].float() for j in range(k))
    write_slots_ref(histories, slots, seq[:, 1:])
    return x + (u + F.silu(out.to(u.dtype)))


def ple_prefill_ref(x: torch.Tensor, key_value: torch.Tensor, histories: torch.Tensor, cu_seqlens: torch.Tensor,
                    norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, conv: torch.Tensor,
                    streams: int, dilation: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The PLE layer over a prefill's packed tokens: `ple_decode_ref` applied to each token of each sequence in
    order, the sequence's history moving on token by token (the contract; a loop, for tests).

    Args:
        x: [T, C*D] the streams of B sequences' new tokens, packed in order; key_value: [T, C*D + D].
        histories: [B, hist, C*D] each sequence's conv history before its tokens (oldest first).
        cu_seqlens: [B + 1] the sequences' offsets (every length >= 1). The rest as `ple_decode_ref`.
    Returns:
        (x + delta [T, C*D], the histories after each sequence's last token [B, hist, C*D])."""
    out = torch.empty_like(x)
    moved = histories.clone()
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        slot = torch.tensor([b], device=x.device)
        for t in range(cu[b], cu[b + 1]):
            out[t:t + 1] = ple_decode_ref(x[t:t + 1], key_value[t:t + 1], moved, slot, norm_key, norm_query, norm_conv,
                                          conv, streams, dilation, eps)
    return out, moved
