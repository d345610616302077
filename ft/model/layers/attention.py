"""Gated full attention (Qwen3-Next): q with an output gate, q/k RMSNorm, partial rotary, GQA."""

from __future__ import annotations

import torch

from ft.model.forward_batch import ForwardBatch
from ft.model.layers.linear import Linear
from ft.model.layers.norm import rms_norm
from ft.model.layers.rotary import Rotary
from ft.kernels.attention import paged_attention_ref, write_kv_ref


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
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]; writes this layer's K/V of the new tokens into `kv` pages."""
        t = x.shape[0]
        qg = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim)
        q, gate = qg.chunk(2, dim=-1)
        gate = gate.reshape(t, -1)
        q = rms_norm(q, self.q_norm, self.eps)
        k = rms_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim), self.k_norm, self.eps)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        k_cache, v_cache = kv
        outs = []
        offset = 0
        for s in batch.seqs:
            sl = slice(offset, offset + s.length)
            write_kv_ref(k_cache, v_cache, k[sl], v[sl], s.page_table, s.start)
            outs.append(paged_attention_ref(q[sl], k_cache, v_cache, s.page_table, s.start, self.scale))
            offset += s.length
        o = torch.cat(outs, dim=0).reshape(t, -1)
        return self.o_proj(o * torch.sigmoid(gate))
