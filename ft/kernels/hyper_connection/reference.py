"""Torch references of the HyperConnection kernels (`ft.kernels.hyper_connection`): Qwen3.8-Flash-Next's
residual of C streams of width D (a [T, C*D] state, stream k at columns [k*D, (k+1)*D)), its grouped
RMSNorm, the read's gated mean over the streams and the write's gated add. These are the model's math
(`ft.model.layers.hyper_connection` composes them; docs/qwen3.8-flash-next/backbone.md, sections
2.1-2.6, is the specification); each rounds where the model's torch ops round.
"""

from __future__ import annotations

import torch

from ft.kernels.norm.reference import rms_norm_ref


def grouped_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """x [..., groups * D] normalised per group of D in fp32, times (1 + weight [groups * D]), in x's dtype:
    Qwen3-Next's zero-centred RMSNorm (`rms_norm_ref`) with a weight row per group."""
    shape = x.shape
    d = shape[-1] // groups
    return rms_norm_ref(x.reshape(*shape[:-1], groups, d), weight.reshape(groups, d), eps).reshape(shape)


def hc_mix_ref(g: torch.Tensor, n: torch.Tensor, streams: int) -> torch.Tensor:
    """The read's block input u [T, D] = mean over k of sigmoid(g_k) * n_k, from the gate's logits
    g [T, C*D] (the up projection's output) and the normalised streams n [T, C*D]: the sigmoid in g's
    dtype, the product in the promoted dtype, the mean accumulated in fp32."""
    t, width = n.shape
    return (torch.sigmoid(g) * n).reshape(t, streams, width // streams).mean(dim=1)


def hc_write_ref(x: torch.Tensor, y: torch.Tensor, gate_logits: torch.Tensor, streams: int,
                 next_norm: torch.Tensor | None = None, eps: float = 1e-6
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The write: the block's output y [T, D] added to every stream of the state x [T, C*D], stream k
    scaled by a_k = 2 sigmoid(gate_logits[:, k]) (gate_logits [T, C] = inject N / C, from the read
    before the block, in the weights' dtype; a in that dtype) -> x' [T, C*D] in x's dtype. With
    next_norm ([C*D], the next read's norm weight): (x', grouped_rms_norm_ref(x', next_norm, C, eps)),
    the next read's first step."""
    t, width = x.shape
    c = streams
    a = 2.0 * torch.sigmoid(gate_logits)  # [T, C]
    out = (x.reshape(t, c, width // c) + a[:, :, None].to(x.dtype) * y[:, None, :]).reshape(t, width)
    if next_norm is None:
        return out
    return out, grouped_rms_norm_ref(out, next_norm, c, eps)


def hc_read_lowrank_ref(n: torch.Tensor, mix_in: torch.Tensor, up: torch.Tensor, rank: int, streams: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The read's two low-rank projections, as the model's torch ops round: z = N mix_in^T / C in the
    weights' dtype (one rounding when C is a power of two: 1 / C is the GEMM's alpha; else the GEMM's
    and the division's), g = silu(z[:, :rank]) up^T. n [T, C*D] the normalised streams (cast to the
    weights' dtype), mix_in [rank + extra, C*D] (down's rows, then inject's: extra = C, or 0 for the
    final read), up [C*D, rank] -> (g [T, C*D], z[:, rank:] [T, extra]: the write's gate logits)."""
    t = n.shape[0]
    c = streams
    nw = n.to(mix_in.dtype)
    if c & (c - 1) == 0:
        z = torch.addmm(nw.new_empty(()).expand(t, mix_in.shape[0]), nw, mix_in.t(), beta=0, alpha=1.0 / c)
    else:
        z = torch.nn.functional.linear(nw, mix_in) / c
    g = torch.nn.functional.linear(torch.nn.functional.silu(z[:, :rank]), up)
    return g, z[:, rank:]


def hc_read_ref(n: torch.Tensor, mix_in: torch.Tensor, up: torch.Tensor, rank: int, streams: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A HyperConnection's read after its norm: (u [T, D] the block's input, the write's gate logits
    [T, extra]) = `hc_read_lowrank_ref` then `hc_mix_ref` (arguments as there)."""
    g, gate_logits = hc_read_lowrank_ref(n, mix_in, up, rank, streams)
    return hc_mix_ref(g, n, streams), gate_logits


def hc_write_read_ref(x: torch.Tensor, y: torch.Tensor, gate_logits: torch.Tensor, streams: int, next_norm: torch.Tensor,
                      eps: float, mix_in: torch.Tensor, up: torch.Tensor, rank: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A write followed by the next read (`hc_write_ref` with the next read's norm, then `hc_read_ref` of
    that read's mix_in and up): (x' [T, C*D], u [T, D] the next block's input, its write's gate logits
    [T, C], or None when mix_in has no inject rows)."""
    out, n = hc_write_ref(x, y, gate_logits, streams, next_norm, eps)
    u, next_gates = hc_read_ref(n, mix_in, up, rank, streams)
    return out, u, (next_gates if mix_in.shape[0] > rank else None)
