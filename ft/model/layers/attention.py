"""Gated full attention (Qwen3-Next): q with an output gate, q/k RMSNorm, partial rotary, GQA."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.model.forward_batch import ForwardBatch
from ft.model.layers.linear import Linear
from ft.kernels.norm import qk_norm_rope
from ft.kernels.attention import calibrate_kv_scale, paged_attention, paged_decode_attention, write_kv, write_kv_decode


@dataclass(frozen=True)
class Rope:
    """Partial rotary embedding: rotate-half over the first `rotary_dim` dims of each head, angles
    positions x inv_freq [rotary_dim / 2] (float32)."""

    rotary_dim: int
    inv_freq: torch.Tensor


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
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj
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
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this layer's K/V of the new tokens into `kv` pages
        (`KVPool.layer`: the K and V caches and the scales of a quantized pool, else None)."""
        t = x.shape[0]
        qg = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim)
        q, gate = qg.chunk(2, dim=-1)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = qk_norm_rope(q, k, self.q_norm, self.k_norm, batch.positions, rope.inv_freq, rope.rotary_dim, self.eps)
        k_cache, v_cache, kv_scale = kv
        if batch.decode is not None:  # one token per sequence: device tensors only (graph-safe)
            d = batch.decode
            write_kv_decode(k_cache, v_cache, k, v, d.slot_mapping, kv_scale)
            # the output gate is applied by the kernel that writes o (a strided view of q_proj's output)
            o = paged_decode_attention(q, k_cache, v_cache, d.page_table, d.seq_lens, self.scale,
                                       max_seq_len=d.max_seq_len, gate=gate, kv_scale=kv_scale)
            return self.o_proj(o.reshape(t, -1))
        if batch.calibrate_kv and kv_scale is not None:  # the first prefill of a cache without scales
            calibrate_kv_scale(k, v, k_cache, kv_scale)
        gate = gate.reshape(t, -1)
        outs = []
        offset = 0
        for s in batch.seqs:
            sl = slice(offset, offset + s.length)
            write_kv(k_cache, v_cache, k[sl], v[sl], s.page_table, s.start, kv_scale)
            outs.append(paged_attention(q[sl], k_cache, v_cache, s.page_table, s.start, self.scale, kv_scale))
            offset += s.length
        o = torch.cat(outs, dim=0).reshape(t, -1)
        return self.o_proj(o * torch.sigmoid(gate))
