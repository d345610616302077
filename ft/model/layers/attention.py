"""Gated full attention (Qwen3-Next): q with an output gate, q/k RMSNorm, partial rotary, GQA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.model.forward_batch import ForwardBatch
from ft.model.layers.linear import Linear, ProjectionGroup
from ft.kernels.norm import qk_norm_rope
from ft.kernels.attention import calibrate_kv_scale, paged_attention, paged_decode_attention, write_kv, write_kv_decode


@dataclass(frozen=True)
class Rope:
    """Partial rotary embedding: rotate-half over the first `rotary_dim` dims of each head, angles
    positions x inv_freq [rotary_dim / 2] (float32); cos and sin times `scale` (YaRN's attention
    factor; 1 for plain RoPE)."""

    rotary_dim: int
    inv_freq: torch.Tensor
    scale: float = 1.0


class GatedAttention:
    def __init__(
        self,
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
        o_proj: Linear,
        q_norm: torch.Tensor,
        k_norm: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
    ) -> None:
        # q (with its output gate), k and v in one launch where the weights stack (`ProjectionGroup`)
        self.qkv, self.o_proj = self._projections(q_proj, k_proj, v_proj), o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps = eps
        self.scale = head_dim**-0.5

    def __call__(
        self,
        x: torch.Tensor,
        rope: Rope,
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        outputs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this layer's K/V of the new tokens into `kv` pages
        (`KVPool.layer`: the K and V caches and the scales of a quantized pool, else None); outputs:
        x's q, k and v projections when the caller computed them (`project`)."""
        t = x.shape[0]
        q, gate, k, v = self.project(x, rope, batch, outputs)
        k_cache, v_cache, kv_scale = kv
        if batch.decode is not None:  # one token per sequence: device tensors only (graph-safe)
            d = batch.decode
            write_kv_decode(k_cache, v_cache, k, v, d.slot_mapping, kv_scale)
            # the output gate is applied by the kernel that writes o (a strided view of q_proj's output)
            o = paged_decode_attention(q, k_cache, v_cache, d.page_table, d.seq_lens, self.scale,
                                       max_seq_len=d.max_seq_len, gate=gate, kv_scale=kv_scale)
            return self.o_proj(o.reshape(t, -1))
        gate = gate.reshape(t, -1)
        if batch.pieces is not None:  # a prefill graph (`ft.engine.worker.prefill_graphs`): the core runs between its pieces
            return self.o_proj(batch.pieces.core(self._prefill_core, kv, q, k, v, gate))
        return self.o_proj(self._prefill_core(batch, kv, q, k, v, gate))

    def _projections(self, q_proj: Linear, k_proj: Linear, v_proj: Linear) -> ProjectionGroup:
        """The group `project` runs (a subclass may lead it with projections of its own)."""
        return ProjectionGroup([q_proj, k_proj, v_proj])

    def project(self, x: torch.Tensor, rope: Rope, batch: ForwardBatch, outputs: list[torch.Tensor] | None = None):
        """x [T, H] -> (q [T, Hq, D] normed and rotated, its output gate [T, Hq, D] (a view of the q
        projection's output), k [T, Hkv, D] normed and rotated, v [T, Hkv, D] (a view)). outputs: the
        q, k and v projections of x already computed (`self.qkv`'s last three)."""
        t = x.shape[0]
        qo, ko, vo = self.qkv(x)[-3:] if outputs is None else outputs
        q, gate = qo.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = ko.view(t, self.num_kv_heads, self.head_dim)
        v = vo.view(t, self.num_kv_heads, self.head_dim)
        q, k = qk_norm_rope(q, k, self.q_norm, self.k_norm, batch.positions, rope.inv_freq, rope.rotary_dim, self.eps)
        if rope.scale != 1.0:  # YaRN: the rotated features scaled as cos and sin are (the kernel has no factor)
            q[..., : rope.rotary_dim] *= rope.scale
            k[..., : rope.rotary_dim] *= rope.scale
        return q, gate, k, v

    def _prefill_core(self, batch: ForwardBatch, kv: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The part of a prefill that depends on where the chunk sits: its K/V written into its pages,
        attention over the cached prefix and itself, the output gate. q [T, Hq, D], k, v [T, Hkv, D],
        gate [T, Hq * D] -> [T, Hq * D] = attention * sigmoid(gate). Only the batch's N real tokens
        are read: T > N rows are a padded prefill graph's (their output rows are zeros in a new
        tensor and left as they are in `out`, [T, Hq * D], which takes the N real rows)."""
        k_cache, v_cache, kv_scale = kv
        t = q.shape[0]
        n = sum(s.length for s in batch.seqs)
        if batch.calibrate_kv and kv_scale is not None:  # the first prefill of a cache without scales
            calibrate_kv_scale(k[:n], v[:n], k_cache, kv_scale)
        outs = []
        rows, first = batch.decode_rows, 0
        if rows is not None:  # a mixed step's decoding rows: one write and one decode attention for all
            first = rows.seq_lens.shape[0]
            write_kv_decode(k_cache, v_cache, k[:first], v[:first], rows.slot_mapping, kv_scale)
            outs.append(paged_decode_attention(q[:first], k_cache, v_cache, rows.page_table, rows.seq_lens, self.scale,
                                               max_seq_len=rows.max_seq_len, kv_scale=kv_scale))
        offset = first
        for s in batch.seqs[first:]:
            sl = slice(offset, offset + s.length)
            write_kv(k_cache, v_cache, k[sl], v[sl], s.page_table, s.start, kv_scale)
            outs.append(paged_attention(q[sl], k_cache, v_cache, s.page_table, s.start, self.scale, kv_scale))
            offset += s.length
        o = (torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]).reshape(n, -1)
        if out is None and n == t:
            return o * torch.sigmoid(gate)
        if out is None:
            out = torch.zeros(t, o.shape[1], dtype=o.dtype, device=o.device)
        torch.mul(o, torch.sigmoid(gate[:n]), out=out[:n])
        return out
