"""Qwen3.8-Flash-Next's Engram n-gram embedding (the checkpoint's "PLE" layer), torch reference.

The model adds, before one decoder layer's first HyperConnection read (0-based layer 1 in the
released checkpoint), a delta computed from the raw token ids alone: each position's 2- and 3-grams
are hashed into a table of ~320M rows x 160 (51.2B parameters, ~102 GB in bf16: it lives in host
memory, and a step reads only the rows its tokens hash to), the 16 rows are concatenated, gated
against the HyperConnection streams, and smoothed by a dilated causal convolution.
docs/qwen3.8-flash-next/qsa-engram.md (sections 6-9) is the specification, with its sources.

This module is the math, in torch, for sequences and for one decode step with carried state:

- `EngramHashing`: the table geometry (per-head prime sizes and offsets) and `rows(...)`, the 16
  table rows of every position (int64). The n-gram context resets after the EOS id; missing context
  is the EOS id.
- `ple_delta(...)`: the delta added to every HyperConnection stream, given the gathered rows and
  the streams; its convolution history is `PLEState.conv` per sequence.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ft.model.layers.hyper_connection import grouped_rms_norm

__all__ = ["DEFAULT_MULTIPLIERS", "PLE_CHUNK_BYTES", "EngramHashing", "PLEWeights", "next_primes", "ple_chunk_tokens",
           "ple_delta", "ple_delta_batched"]

DEFAULT_MULTIPLIERS = (23703573157769, 20109073645365, 8052911324071)
"""The hash's odd int64 multipliers: index 0 multiplies the current token, 1 the previous, 2 the one
before. Fixed constants of the released checkpoint (its `layer_multipliers` buffer), not derived."""


def next_primes(base: int, count: int) -> list[int]:
    """The `count` smallest primes greater than `base`, ascending (trial division: bases ~2e7 are cheap)."""
    out, n = [], base + 1
    while len(out) < count:
        if n > 1 and all(n % p for p in range(2, math.isqrt(n) + 1)):
            out.append(n)
        n += 1
    return out


@functools.lru_cache(maxsize=None)
def _head_constants(sizes: tuple[int, ...], offsets: tuple[int, ...], device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' sizes and offsets as int64 tensors on `device`, made once: a CUDA graph's capture
    cannot copy from pageable host memory, and its eager first step makes them before it."""
    return (torch.tensor(sizes, dtype=torch.int64, device=device),
            torch.tensor(offsets, dtype=torch.int64, device=device))


@dataclass(frozen=True)
class EngramHashing:
    """Where the n-grams of raw token ids land in the table.

    Orders 2 .. ngram_size each have `heads_per_ngram` heads (order 2's heads first); head k's rows are
    [offsets[k], offsets[k] + sizes[k]) with sizes the smallest primes above `vocab_size_base`, in head
    order; the table has `padded_rows` rows (the sum rounded up to `divisible_by`)."""

    ngram_size: int = 3
    heads_per_ngram: int = 8
    vocab_size_base: int = 20_000_000
    divisible_by: int = 128
    eos_token_id: int = 248044
    multipliers: tuple[int, ...] = DEFAULT_MULTIPLIERS
    sizes: tuple[int, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        if self.ngram_size < 2 or self.heads_per_ngram < 1:
            raise ValueError(f"ngram_size {self.ngram_size} must be >= 2 and heads_per_ngram "
                             f"{self.heads_per_ngram} >= 1")
        if len(self.multipliers) < self.ngram_size:
            raise ValueError(f"{len(self.multipliers)} hash multipliers for n-grams of {self.ngram_size}")
        sizes = next_primes(self.vocab_size_base, (self.ngram_size - 1) * self.heads_per_ngram)
        offsets = [0]
        for s in sizes[:-1]:
            offsets.append(offsets[-1] + s)
        object.__setattr__(self, "sizes", tuple(sizes))
        object.__setattr__(self, "offsets", tuple(offsets))

    def head_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The heads' sizes and offsets as int64 tensors on `device` (made once per device)."""
        return _head_constants(self.sizes, self.offsets, device)

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def context_len(self) -> int:
        """Previous token ids a sequence carries between steps."""
        return self.ngram_size - 1

    @property
    def padded_rows(self) -> int:
        total = sum(self.sizes)
        return -(-total // self.divisible_by) * self.divisible_by

    def empty_context(self) -> list[int]:
        """The context of a sequence before its first token (the EOS id: "no context")."""
        return [self.eos_token_id] * self.context_len

    def rows(self, ids: torch.Tensor, context: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """Table rows of one sequence's tokens.

        Args:
            ids: [T] int token ids (any integer dtype, any device).
            context: the `context_len` ids before ids[0] (`empty_context()` at the sequence's start).
        Returns:
            (rows [T, num_heads] int64 on ids' device, the context after ids[-1]).

        Position t's shift-s token is ids[t - s] if no EOS lies strictly between t - s and t, else
        the EOS id; with the context prepended (EOS where there is none) that one rule covers the
        sequence's start and chunk boundaries alike."""
        context = self.empty_context() if context is None else list(context)
        if len(context) != self.context_len:
            raise ValueError(f"context must hold {self.context_len} ids, got {len(context)}")
        n, c = ids.numel(), self.context_len
        ext = torch.cat([torch.tensor(context, dtype=torch.int64, device=ids.device), ids.reshape(-1).to(torch.int64)])
        windows = torch.stack([ext[c - s: c - s + n] for s in range(self.ngram_size)], dim=1)
        return self.rows_of_windows(windows), ext[-c:].tolist()

    def rows_of_windows(self, windows: torch.Tensor) -> torch.Tensor:
        """[T, ngram_size] int64: each position's token (column 0) and the ones before it (column s:
        s back; the EOS id where the sequence had none) -> its table rows [T, num_heads] int64.

        The shift-s token becomes the EOS id when an EOS lies strictly between it and the position
        (columns 1 .. s-1), so the context never reaches past an EOS."""
        eos = torch.full_like(windows[:, 0], self.eos_token_id)
        mixes, mix, cut = [], None, torch.zeros_like(windows[:, 0], dtype=torch.bool)
        for s in range(self.ngram_size):
            token = windows[:, s]
            if s >= 2:  # an EOS at shift s - 1 (strictly between t - s and t) ends the context
                cut = cut | (windows[:, s - 1] == self.eos_token_id)
                token = torch.where(cut, eos, token)
            term = token * self.multipliers[s]  # int64, wrapping
            mix = term if mix is None else mix ^ term
            if s >= 1:
                mixes.append(mix)  # order s + 1
        sizes, offsets = _head_constants(self.sizes, self.offsets, windows.device)
        per_head = torch.stack([m for m in mixes for _ in range(self.heads_per_ngram)], dim=1)  # [T, heads]
        return torch.remainder(per_head, sizes) + offsets

    def windows(self, ids: torch.Tensor, contexts: torch.Tensor, cu_seqlens: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's n-gram windows, on the device and without a host read (a CUDA graph may hold it).

        Args:
            ids: [T] int64 the new tokens of B sequences, flattened in order.
            contexts: [B, context_len] int64 each sequence's previous ids, oldest first (the EOS id for none).
            cu_seqlens: [B + 1] the sequences' offsets in ids (every length >= 1).
        Returns:
            (windows [T, ngram_size] for `rows_of_windows`, the contexts after each sequence's last token)."""
        t, c = ids.shape[0], self.context_len
        seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64), torch.arange(t, device=ids.device), right=True)
        local = torch.arange(t, device=ids.device) - cu_seqlens.to(torch.int64)[seq]
        cols = [ids.to(torch.int64)]
        for s in range(1, self.ngram_size):
            inside = local >= s
            from_ids = ids.to(torch.int64)[torch.clamp(torch.arange(t, device=ids.device) - s, min=0)]
            from_context = contexts[seq, torch.clamp(c - s + local, min=0, max=c - 1)]
            cols.append(torch.where(inside, from_ids, from_context))
        windows = torch.stack(cols, dim=1)
        last = windows[cu_seqlens[1:].to(torch.int64) - 1]  # [B, n]: each sequence's last window
        return windows, last[:, :c].flip(1)  # (the new context, oldest first: shifts c - 1 .. 0)


@dataclass(frozen=True)
class PLEWeights:
    """The PLE layer's tensors (checkpoint names under `...layers.{i}.ple.`), for C streams of width D
    and an embedding of width E (the 16 rows of 160 concatenated: 2,560).

    key_proj [C*D, E], value_proj [D, E]; norm_key, norm_query, norm_conv [C*D] (grouped RMSNorm
    weights, applied as 1 + w); conv [C*D, K] (the depthwise kernel, `conv1d.weight` [C*D, 1, K]
    squeezed), dilation `dilation` (the n-gram size); eps of the norms."""

    key_proj: torch.Tensor
    value_proj: torch.Tensor
    norm_key: torch.Tensor
    norm_query: torch.Tensor
    norm_conv: torch.Tensor
    conv: torch.Tensor
    streams: int
    dilation: int = 3
    eps: float = 1e-6

    @property
    def history(self) -> int:
        """Conv inputs a sequence carries: (K - 1) x dilation (9 for the released checkpoint)."""
        return (self.conv.shape[-1] - 1) * self.dilation


def ple_delta(embedding: torch.Tensor, streams: torch.Tensor, w: PLEWeights,
              conv_history: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta one sequence's tokens add to every HyperConnection stream.

    Args:
        embedding: [T, E] the concatenated table rows of each token (the model's dtype).
        streams: [T, C, D] the HyperConnection state entering the PLE layer's decoder layer.
        conv_history: [history, C*D] the conv inputs of the sequence's previous `history` tokens
            (oldest first; zeros before its start, the default).
    Returns:
        (delta [T, C*D] to add to the streams flattened stream-major, the new conv history).

    Per token and stream h: a scalar gate sigmoid(ssqrt(<norm_key(key_proj e)_h, norm_query(H)_h> / sqrt(D)))
    (ssqrt: the signed square root of |g| floored at 1e-6) scales one shared value v = value_proj e;
    u = the gated values, u_hat = norm_conv(u), and delta = u + silu(conv(u_hat)) with the conv causal,
    depthwise, dilated. Arithmetic in the inputs' dtype where the reference keeps it (norms in fp32)."""
    t, c, d = streams.shape
    if c != w.streams:
        raise ValueError(f"{c} streams, the PLE weights are for {w.streams}")
    key = grouped_rms_norm(F.linear(embedding, w.key_proj), w.norm_key, c, w.eps).reshape(t, c, d)
    query = grouped_rms_norm(streams.reshape(t, c * d), w.norm_query, c, w.eps).reshape(t, c, d)
    value = F.linear(embedding, w.value_proj)  # [T, D]
    g = (key * query).sum(-1) / math.sqrt(d)  # [T, C]
    g = torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6))
    u = (torch.sigmoid(g)[:, :, None] * value[:, None, :]).reshape(t, c * d)
    u_hat = grouped_rms_norm(u, w.norm_conv, c, w.eps)
    hist = w.history
    if conv_history is None:
        conv_history = torch.zeros(hist, c * d, dtype=u_hat.dtype, device=u_hat.device)
    seq = torch.cat([conv_history.to(u_hat.dtype), u_hat])  # [hist + T, C*D]: row hist + t is token t
    k = w.conv.shape[-1]
    conv = sum(seq[j * w.dilation: j * w.dilation + t].float() * w.conv[:, j].float() for j in range(k))
    delta = u + F.silu(conv.to(u.dtype))
    return delta, seq[-hist:].clone()


PLE_CHUNK_BYTES = 256 << 20
"""What `ple_delta_batched`'s per-chunk temporaries may hold (bytes): its gate and its convolution run over the
packed tokens in chunks of `ple_chunk_tokens`, so that a prefill's transients beside the whole-batch tensors stay
this size at any chunk length (unchunked, a 16K-token prefill held ~240 KiB a token here: 3.7 GiB, over the
activation reserve's per-token estimate; `ft.engine.ranks.loader.activation_reserve` counts this bound)."""


def ple_chunk_tokens(streams: int, width: int) -> int:
    """Tokens a chunk of `ple_delta_batched` handles: its temporaries bounded by `PLE_CHUNK_BYTES` (about six
    fp32 [tokens, C*D] tensors at the worst moment, the torch norms' upcasts counted)."""
    return max(16, PLE_CHUNK_BYTES // (6 * 4 * streams * width))


def ple_delta_batched(embedding: torch.Tensor, streams: torch.Tensor, w: PLEWeights, histories: torch.Tensor,
                      cu_seqlens: torch.Tensor, chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`ple_delta` for B sequences at once, on the device and without a host read.

    Args:
        embedding: [T, E], streams: [T, C, D] the new tokens of B sequences, flattened in order.
        histories: [B, history, C*D] each sequence's conv history (as `ple_delta`'s conv_history).
        cu_seqlens: [B + 1] the sequences' offsets (every length >= 1).
        chunk_tokens: tokens a chunk of the elementwise work (default `ple_chunk_tokens`); any value gives
            the same bits (each op is per token, or per token and channel, in the same order).
    Returns:
        (delta [T, C*D], the new histories [B, history, C*D]): per sequence what `ple_delta` returns.

    Memory: besides its inputs, two [T, C*D] tensors in the activations' dtype for the whole call (the key
    projection, later the convolution's inputs) and the delta, plus one chunk's temporaries."""
    t, c, d = streams.shape
    if c != w.streams:
        raise ValueError(f"{c} streams, the PLE weights are for {w.streams}")
    step = max(1, chunk_tokens or ple_chunk_tokens(c, d))
    key_all = F.linear(embedding, w.key_proj)  # [T, C*D] (whole: a GEMM's bits may follow its row count)
    value = F.linear(embedding, w.value_proj)  # [T, D]
    u = torch.empty(t, c * d, dtype=value.dtype, device=value.device)  # the gated values, later the delta
    for a in range(0, t, step):
        z = min(t, a + step)
        key = grouped_rms_norm(key_all[a:z], w.norm_key, c, w.eps).reshape(z - a, c, d)
        query = grouped_rms_norm(streams[a:z].reshape(z - a, c * d), w.norm_query, c, w.eps).reshape(z - a, c, d)
        g = (key * query).sum(-1) / math.sqrt(d)
        g = torch.sign(g) * torch.sqrt(torch.clamp(g.abs(), min=1e-6))
        u[a:z] = (torch.sigmoid(g)[:, :, None] * value[a:z, None, :]).reshape(z - a, c * d)
    del key_all
    b, hist = histories.shape[0], w.history
    # every row a tap may read: the B histories (row b * hist + j), then this batch's u_hat (row B * hist + t)
    rows = torch.empty(b * hist + t, c * d, dtype=u.dtype, device=u.device)
    rows[:b * hist] = histories.to(u.dtype).reshape(b * hist, c * d)
    for a in range(0, t, step):
        rows[b * hist + a: b * hist + min(t, a + step)] = grouped_rms_norm(u[a:a + step], w.norm_conv, c, w.eps)
    cu = cu_seqlens.to(torch.int64)
    positions = torch.arange(t, device=u.device)
    seq = torch.searchsorted(cu[1:], positions, right=True)
    local = positions - cu[seq]

    def source(back: torch.Tensor | int, at: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        """The row of position `at - back` of sequence `owner` (at: its local index): in this batch or
        in its history."""
        p = at - back
        return torch.where(p >= 0, b * hist + cu[owner] + p, owner * hist + hist + p)

    k = w.conv.shape[-1]
    taps = [w.conv[:, j].float() for j in range(k)]
    for a in range(0, t, step):  # delta = u + silu(conv(u_hat)), the taps summed in fp32 in order, into u
        z = min(t, a + step)
        conv = sum(rows[source((k - 1 - j) * w.dilation, local[a:z], seq[a:z])].float() * taps[j] for j in range(k))
        u[a:z] += F.silu(conv.to(u.dtype))
    lengths = cu[1:] - cu[:-1]  # [B]
    keep = torch.arange(hist, device=u.device)[None, :] - hist  # the last `hist` positions, oldest first
    owner = torch.arange(b, device=u.device)[:, None].expand(b, hist)
    new = rows[source(0, lengths[:, None] + keep, owner)]  # [B, hist, C*D]
    return u, new.to(histories.dtype)
