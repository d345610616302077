"""Gated DeltaNet (the linear attention of Qwen3-Next and of Qwen3.8-Flash-Next) over the mamba state pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ft.model.forward_batch import ForwardBatch
from ft.model.layers.linear import Linear, NVFP4Weight
from ft.kernels.conv1d import causal_conv1d_ref, causal_conv1d_varlen
from ft.kernels.gated_delta import chunk_gated_delta_rule_varlen, gated_delta_decode, gated_delta_rule
from ft.kernels.norm import gated_rms_norm


class GatedDeltaNet:
    def __init__(
        self,
        in_proj_qkvz: Linear,
        in_proj_ba: Linear,
        conv_weight: torch.Tensor,
        out_proj: Linear,
        norm_weight: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        eps: float,
        rows_per_head: bool = True,
        output_gate: str = "silu",
    ) -> None:
        """rows_per_head: the projections' rows interleaved per key head (Qwen3-Next's fused
        in_proj_qkvz / in_proj_ba), else already [q | k | v | z] and [b | a] (Qwen3.8-Flash-Next's
        split projections, stacked). output_gate: the gated norm's activation, "silu" or "sigmoid"."""
        self.in_proj_qkvz, self.in_proj_ba, self.out_proj = in_proj_qkvz, in_proj_ba, out_proj
        self.output_gate = output_gate
        self.conv_weight = conv_weight.reshape(conv_weight.shape[0], -1)  # [C, W]
        self.norm_weight, self.a_log, self.dt_bias = norm_weight, a_log, dt_bias
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.eps = eps
        # NOTE: the checkpoint interleaves the projections per key head ([q k v z] of head 0, then of
        # head 1, ...; [b a] likewise). Their rows are reordered once here to [q of every head | k | v
        # | z] and [b | a], so that mixed qkv, z, b and a are column slices of the outputs: no copy.
        r = num_v_heads // num_k_heads
        if not rows_per_head:
            return
        self.in_proj_qkvz = in_proj_qkvz.with_rows(_grouped_rows(num_k_heads, [head_k_dim, head_k_dim, r * head_v_dim,
                                                                                r * head_v_dim]))
        self.in_proj_ba = in_proj_ba.with_rows(_grouped_rows(num_k_heads, [r, r]))

    def _project(self, x: torch.Tensor, ba: bool = True):
        """x [T, H] -> mixed qkv [T, C], z [T, Hv, Dv], b, a [T, Hv] (None, None without `ba`): views of
        the two projections' outputs (rows grouped at load time, see __init__)."""
        t, c = x.shape[0], 2 * self.hk * self.dk + self.hv * self.dv
        qkvz = self.in_proj_qkvz(x)
        mixed, z = qkvz[:, :c], qkvz[:, c:].view(t, self.hv, self.dv)
        if not ba:
            return mixed, z, None, None
        ba_out = self.in_proj_ba(x)
        return mixed, z, ba_out[:, : self.hv], ba_out[:, self.hv :]

    def _mix(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor):
        """One group of sequences of equal length: mixed [B, L, C], b, a [B, L, Hv]; states [B, ...]."""
        bsz, length = mixed.shape[:2]
        y, conv_new = causal_conv1d_ref(mixed, conv, self.conv_weight)
        kd = self.hk * self.dk
        q, k, v = torch.split(y, [kd, kd, self.hv * self.dv], dim=-1)
        q = q.reshape(bsz, length, self.hk, self.dk)
        k = k.reshape(bsz, length, self.hk, self.dk)
        v = v.reshape(bsz, length, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o, ssm_new = gated_delta_rule(q, k, v, g, beta, ssm)
        return o.to(mixed.dtype), conv_new, ssm_new

    def __call__(
        self, x: torch.Tensor, batch: ForwardBatch, conv_pool: torch.Tensor, ssm_pool: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]. conv_pool [S, C, W-1], ssm_pool [S, Hv, Dk, Dv]: this layer's states,
        read at each sequence's slot and written back."""
        t = x.shape[0]
        # a decode step leaves in_proj_ba (dense) to the conv launch: b, a computed there, one launch fewer
        ba_in_conv = batch.is_decode and not isinstance(self.in_proj_ba.weight, NVFP4Weight)
        mixed, z, b, a = self._project(x, ba=not ba_in_conv)
        if batch.is_decode:  # one launch pair per layer, slots indexed in the kernels (graph-safe)
            # NOTE: the gated RMSNorm stays a launch of its own: folded into this step (one program per
            # value head, to own a whole Dv row) it measured slower on the H200 (10.4 against 6.9 us per
            # layer at batch 1, 21.9 against 16.5 at batch 8; bench/RESULTS.md)
            o = gated_delta_decode(mixed, b, a, conv_pool, ssm_pool, self.conv_weight, self.a_log, self.dt_bias,
                                   batch.mamba_slots,
                                   ba_proj=(x.reshape(t, -1), self.in_proj_ba.weight) if ba_in_conv else None)
        elif batch.decode_rows is not None:  # a mixed step: its leading one-token rows (the running decodes)
            # as one recurrent step, the decode step's kernels, and the prompts as a packed prefill of their own,
            # so that the chunked kernels do not take each decoding row for a sequence of a chunk
            first = batch.decode_rows.seq_lens.shape[0]
            o = mixed.new_empty(t, self.hv, self.dv)
            gated_delta_decode(mixed[:first], b[:first], a[:first], conv_pool, ssm_pool, self.conv_weight,
                               self.a_log, self.dt_bias, batch.mamba_slots[:first], out=o[:first])
            self._prefill(mixed[first:], b[first:], a[first:], conv_pool, ssm_pool, batch.cu_seqlens[first:] - first,
                          batch.mamba_slots[first:], out=o[first:])
        else:  # prefill: the packed batch, no loop over sequences on the Triton path (the references loop)
            # rows past the sequences' tokens (a padded prefill graph, `ft.engine.worker.prefill_graphs`) are
            # skipped by both kernels: their output starts at zero so that what follows stays finite
            pad = t > sum(s.length for s in batch.seqs)
            o = self._prefill(mixed, b, a, conv_pool, ssm_pool, batch.cu_seqlens, batch.mamba_slots,
                              out=mixed.new_zeros(t, self.hv, self.dv) if pad else None)
        # z stays a strided view of in_proj_qkvz's output: the norm kernel reads it in place
        o = gated_rms_norm(o.reshape(t, self.hv, self.dv), z, self.norm_weight, self.eps, self.output_gate)
        return self.out_proj(o.reshape(t, -1))

    def _prefill(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_pool: torch.Tensor,
                 ssm_pool: torch.Tensor, cu: torch.Tensor, slots: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Sequences packed along T (cu [B+1], slots [B] on the device): mixed [T, C], b, a [T, Hv] ->
        o [T, Hv, Dv] (into `out` when given), the conv and the chunked rule in one launch and two, their
        states at slots read and replaced."""
        t = mixed.shape[0]
        y = causal_conv1d_varlen(mixed, conv_pool, self.conv_weight, cu, slots)  # one launch
        kd = self.hk * self.dk
        q = y[:, :kd].view(t, self.hk, self.dk)
        k = y[:, kd : 2 * kd].view(t, self.hk, self.dk)
        v = y[:, 2 * kd :].view(t, self.hv, self.dv)
        beta = b.sigmoid()
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return chunk_gated_delta_rule_varlen(q, k, v, g, beta, ssm_pool, cu, slots, out=out)  # two launches


def _grouped_rows(groups: int, parts: list[int]) -> torch.Tensor:
    """Row order that turns rows laid out per group ([part 0, part 1, ...] of group 0, then group
    1, ...) into rows per part (part 0 of every group, then part 1, ...)."""
    width = sum(parts)
    order, offset = [], 0
    for size in parts:
        for g in range(groups):
            order.extend(range(g * width + offset, g * width + offset + size))
        offset += size
    return torch.tensor(order, dtype=torch.int64)
