"""QSA attention (Qwen3.8-Flash-Next) over the paged KV cache: gated attention whose queries attend only
to the tokens the indexer selects (`ft.model.layers.qsa` is the math and its specification).

Every step stores each new token's K, V and raw indexer key in its page. A prefill whose context fits
`dense_limit` (budget + ratio - 1 tokens: the indexer then selects every token) runs the gated
attention kernels unchanged: there dense attention is QSA exactly. A decode step, at any length,
runs the selection in fixed shapes (a CUDA graph holds them): `ft.kernels.qsa.block_scores` (Triton:
each block's raw keys read through the page table, meaned, normed, rotated, scored; bounded by each
sequence's length), `select_decode_tokens` (Triton: the best blocks, ties to the lower block), one
`sparse_decode_attention` launch (split-K over the lists). A prefill past the span runs its queries still
inside it (positions below `dense_limit`) through the causal prefill attention, and selects for the rest
(their raw keys gathered from the pages and compressed, each query's blocks chosen, by default by the
decode path's top-k, in blocks of queries) and attends with the same kernel, each query a row with its
own list (one split a row at a prefill's thousands: `QsaOptions.one_pass`). The score kernel re-reads
every raw key each step (4x a compressed cache's bytes): a compressed-key cache is the next step (issue 38).
"""

from __future__ import annotations

import torch

from ft.kernels.attention import paged_attention, sparse_decode_attention, write_kv, write_kv_decode
from ft.kernels.backend import uses_triton
from ft.kernels.norm import norm_rope, rms_norm
from ft.kernels.options import kernel_options
from ft.model.forward_batch import DecodeMeta, ForwardBatch
from ft.model.layers.attention import GatedAttention, Rope
from ft.model.layers.linear import Linear, ProjectionGroup
from ft.kernels.qsa import block_scores, select_decode_tokens
from ft.model.layers.qsa import compress_keys, select_tokens, selection_scores

__all__ = ["QSAAttention", "rotate"]

SCORE_BYTES = 256 << 20
"""Bound on the fp32 block scores a block of prefill queries holds while it selects."""


def rotate(x: torch.Tensor, positions: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate-half RoPE of x [T, H, D] at positions [T] on its first rope.rotary_dim features (the rest
    pass), cos and sin in x's dtype times rope.scale: the reference forward's rotation."""
    half, rot = rope.rotary_dim // 2, rope.rotary_dim
    ang = positions.float()[:, None] * rope.inv_freq[None, :].to(positions.device)
    cos = (ang.cos() * rope.scale)[:, None, :].to(x.dtype)
    sin = (ang.sin() * rope.scale)[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:rot]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], dim=-1)


class QSAAttention(GatedAttention):
    def __init__(self, q_proj: Linear, k_proj: Linear, v_proj: Linear, o_proj: Linear, q_norm: torch.Tensor,
                 k_norm: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                 index_qk: Linear, index_q_norm: torch.Tensor, index_k_norm: torch.Tensor, index_heads: int,
                 index_dim: int, budget: int, ratio: int) -> None:
        """The gated attention's tensors, then the indexer's: index_qk [(Hi + 1) * Di, H] (Hi query heads,
        then the one key head), its q and k RMSNorm weights [Di]; budget tokens chosen in blocks of
        `ratio`."""
        self.index_q_norm, self.index_k_norm = index_q_norm, index_k_norm
        self._index_qk = index_qk  # (led into the q / k / v group by `_projections`, then dropped)
        super().__init__(q_proj, k_proj, v_proj, o_proj, q_norm, k_norm, num_heads, num_kv_heads, head_dim, eps)
        del self._index_qk
        self.index_heads, self.index_dim = index_heads, index_dim
        self.budget_blocks, self.ratio = budget // ratio, ratio
        self.dense_limit = budget + ratio - 1

    def _projections(self, q_proj: Linear, k_proj: Linear, v_proj: Linear) -> ProjectionGroup:
        """The indexer's projection, then q / k / v: one launch where the weights stack."""
        return ProjectionGroup([self._index_qk, q_proj, k_proj, v_proj])

    def __call__(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch, kv: tuple,  # type: ignore[override]
                 index_keys: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes the new tokens' K/V into `kv` (`KVPool.layer`) and their raw
        indexer keys into `index_keys` [P, page_size, Di] (`KVPool.index_layer`)."""
        t, hi, di = x.shape[0], self.index_heads, self.index_dim
        iqk, *qkv = self.qkv(x)
        if batch.decode is None:  # (a decode step writes them with its K and V, one launch)
            self._write_index_keys(index_keys, iqk[:, hi * di:], batch)
        # a decode step always takes the fixed-shape path (inside the dense span it selects every token):
        # no host branch on the lengths, so a CUDA graph may hold it
        if batch.decode is None and max(s.start + s.length for s in batch.seqs) <= self.dense_limit:
            return super().__call__(x, rope, batch, kv, qkv)  # every token selected: dense attention is QSA
        q, gate, k, v = self.project(x, rope, batch, qkv)
        iq = norm_rope(iqk[:, : hi * di].reshape(t, hi, di), self.index_q_norm, batch.positions, rope.inv_freq,
                       rope.rotary_dim, self.eps)  # (one launch: `rotate`'s math, cos and sin unscaled)
        if rope.scale != 1.0:  # YaRN: the rotated features scaled as `rotate` scales cos and sin
            iq[..., : rope.rotary_dim] *= rope.scale
        k_cache, v_cache, kv_scale = kv
        if batch.decode is not None:  # the new K, V and raw indexer keys at each token's slot
            write_kv_decode(k_cache, v_cache, k, v, batch.decode.slot_mapping, kv_scale,
                            extra=(index_keys, iqk[:, hi * di:]))
            # one list of positions per sequence, one launch for the batch
            return self.o_proj(self._decode(q, iq, gate, batch.decode, kv, index_keys, rope).reshape(t, -1))
        # a mixed step's decoding rows (`ForwardBatch.decode_rows`, the leading one-token sequences): as a
        # decode batch, one selection and one attention launch for all (their indexer keys were written first)
        decoding, first, outs = batch.decode_rows, 0, []
        if decoding is not None:
            first = decoding.seq_lens.shape[0]
            write_kv_decode(k_cache, v_cache, k[:first], v[:first], decoding.slot_mapping, kv_scale)
            outs.append(self._decode(q[:first], iq[:first], None, decoding, kv, index_keys, rope))
        offset = first
        for s in batch.seqs[first:]:  # each prompt's K and V, then its attention (which reads only its own pages)
            rows = slice(offset, offset + s.length)
            offset += s.length
            write_kv(k_cache, v_cache, k[rows], v[rows], s.page_table, s.start, kv_scale)
            if s.start + s.length <= self.dense_limit:
                outs.append(paged_attention(q[rows], k_cache, v_cache, s.page_table, s.start, self.scale, kv_scale))
            else:
                outs.append(self._sparse(q[rows], iq[rows], s.start, s.page_table, kv, index_keys, rope))
        o = torch.cat(outs).reshape(offset, -1)
        if offset < t:  # (padded rows: none on this eager path, kept finite)
            o = torch.cat([o, o.new_zeros(t - offset, o.shape[1])])
        return self.o_proj(o * torch.sigmoid(gate.reshape(t, -1)))

    def _write_index_keys(self, index_keys: torch.Tensor, raw: torch.Tensor, batch: ForwardBatch) -> None:
        """A prefill's raw indexer keys into their pages (a decode step's go with its K and V; a mixed step's
        decoding rows, `ForwardBatch.decode_rows`, in one write at their slots)."""
        page = index_keys.shape[1]
        offset, seqs = 0, batch.seqs
        if batch.decode_rows is not None:
            slots = batch.decode_rows.slot_mapping
            offset = slots.shape[0]
            index_keys[slots // page, slots % page] = raw[:offset].to(index_keys.dtype)
            seqs = seqs[offset:]
        for s in seqs:
            pos = torch.arange(s.start, s.start + s.length, device=raw.device)
            index_keys[s.page_table[pos // page], pos % page] = raw[offset: offset + s.length].to(index_keys.dtype)
            offset += s.length

    def _blocks(self, total: int, page_table: torch.Tensor, index_keys: torch.Tensor, rope: Rope) -> torch.Tensor:
        """A sequence's compressed indexer keys [V, Di] (normed, rotated at each block's first position)
        from the raw keys of its positions 0 .. total - 1 in the pages."""
        page = index_keys.shape[1]
        pos = torch.arange(total, device=page_table.device)
        blocks = compress_keys(index_keys[page_table[pos // page], pos % page], self.ratio)
        blocks = rms_norm(blocks, self.index_k_norm, self.eps)[:, None, :]
        return rotate(blocks, torch.arange(blocks.shape[0], device=blocks.device) * self.ratio, rope)[:, 0]

    def _decode(self, q: torch.Tensor, iq: torch.Tensor, gate: torch.Tensor | None, d: DecodeMeta, kv: tuple,
                index_keys: torch.Tensor, rope: Rope) -> torch.Tensor:
        """A decode batch (`d`: a decode step's, or a mixed step's decoding rows) in fixed shapes and device
        ops only: every sequence's block scores (`block_scores`, bounded by its length), its positions
        (`select_decode_tokens`: all of them inside the dense span), then `sparse_decode_attention` over the
        batch, its output gated by the kernel that writes it where `gate` is given -> [B, Hq, D]."""
        k_cache, v_cache, kv_scale = kv
        # (inside the budget every complete block is taken: no scores computed, `dense_blocks`)
        scores = block_scores(iq, index_keys, d.page_table, d.seq_lens, self.index_k_norm, self.eps, rope.inv_freq,
                              rope.scale, self.ratio, -(-d.max_seq_len // self.ratio), dense_blocks=self.budget_blocks)
        tokens = select_decode_tokens(scores, d.seq_lens, self.budget_blocks, self.ratio)
        return sparse_decode_attention(q, k_cache, v_cache, d.page_table, tokens, self.scale, kv_scale, gate=gate)

    def _sparse(self, q: torch.Tensor, iq: torch.Tensor, start: int, page_table: torch.Tensor, kv: tuple,
                index_keys: torch.Tensor, rope: Rope) -> torch.Tensor:
        """One sequence's queries q [n, Hq, D] at positions start.. (indexer queries iq [n, Hi, Di]) over
        the tokens each selects, its context 0 .. start + n - 1 read from the pages -> [n, Hq, D]. The
        queries whose context fits the dense span (positions below `dense_limit`: the indexer selects every
        token) run the causal prefill attention, which QSA is there; each later query a row of
        `sparse_decode_attention` (its list, the sequence's page table), in blocks of queries that bound the
        selection's scores ([n, Hi, blocks] fp32)."""
        k_cache, v_cache, kv_scale = kv
        n, total = q.shape[0], start + q.shape[0]
        dense = min(n, max(0, self.dense_limit - start))
        out = [paged_attention(q[:dense], k_cache, v_cache, page_table, start, self.scale, kv_scale)] if dense else []
        blocks = self._blocks(total, page_table, index_keys, rope)  # [V, Di]: the complete blocks
        step = max(1, SCORE_BYTES // (4 * self.index_heads * max(1, blocks.shape[0])))
        if not uses_triton(q.device):  # the reference gathers each row's K and V (fp32): bound those too
            width = self.budget_blocks * self.ratio + self.ratio - 1
            step = min(step, max(1, SCORE_BYTES // (2 * 4 * width * self.num_kv_heads * self.head_dim)))
        for a in range(dense, n, step):
            rows = min(n, a + step) - a
            qpos = torch.arange(start + a, start + a + rows, device=q.device)
            if kernel_options().qsa.prefill_select_kernel:  # the same set, by the decode path's top-k
                scores = selection_scores(iq[a: a + rows], blocks, qpos, self.ratio)
                tokens = select_decode_tokens(scores, qpos + 1, self.budget_blocks, self.ratio)
            else:
                tokens = select_tokens(iq[a: a + rows], blocks, qpos, self.budget_blocks, self.ratio)
            out.append(sparse_decode_attention(q[a: a + rows], k_cache, v_cache, page_table[None].expand(rows, -1),
                                               tokens, self.scale, kv_scale))
        return torch.cat(out)
