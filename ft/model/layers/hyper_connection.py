"""Qwen3.8-Flash-Next's HyperConnections.

The residual is C streams of the hidden width D (C = 4: a [T, C*D] state, stream-major: stream k is
columns [k*D, (k+1)*D)), made by copying the embedding into every stream. Around each block a read
mixes the streams into the block's input and a write adds the block's output back to every stream,
each through its own scalar gate; the model's end is a read alone (there is no other final norm).
docs/qwen3.8-flash-next/backbone.md, sections 2.1-2.6, is the specification, with its sources.

    read:   N = grouped_rms_norm(X)                      (per stream over D, fp32, times 1 + w)
            G = sigmoid(W_up silu(W_down N / C))         [T, C*D]
            u = mean over k of G_k * N_k                 [T, D]: the block's input
    write:  a = 2 sigmoid(W_inject N / C)                [T, C], N from the same read
            X'_k = X_k + a_k y                           y [T, D]: the block's output

The elementwise steps are `ft.kernels.hyper_connection` (its references are this math in torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.kernels.hyper_connection import grouped_rms_norm, hc_mix, hc_write

__all__ = ["HyperConnection", "expand_streams", "grouped_rms_norm"]


def expand_streams(embedding: torch.Tensor, streams: int) -> torch.Tensor:
    """[T, D] -> [T, streams * D]: the embedding copied into every stream (no scale, no parameters)."""
    return embedding.repeat(1, streams)


@dataclass(frozen=True)
class HyperConnection:
    """One HyperConnection module's tensors (checkpoint names under `...{attn,mlp}_hyper_connection.`
    or `hyper_connection_mixer.`): norm `hc_norm.weight` [C*D]; down `input_mix_weight_down.weight`
    [r, C*D]; up `input_mix_weight_up.weight` [C*D, r]; inject `block_inject_weight.weight` [C, C*D],
    None for the final read, which has no write.

    On the hot path (`ft.kernels.hyper_connection`) a read is its norm (or the one the previous write
    computed), the two low-rank GEMMs (the 1 / C in the first one's alpha) with a SiLU between, and
    one launch for the gated mean; a write is one launch that also computes the next read's norm."""

    norm: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    inject: torch.Tensor | None
    streams: int
    eps: float = 1e-6

    def read(self, x: torch.Tensor, n: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, C*D] -> (u [T, D] the block's input, N [T, C*D] the normalised streams for `write`);
        n: N when the previous write computed it (`write(..., next_hc=self)`)."""
        t, width = x.shape
        c = self.streams
        if width != self.norm.shape[0]:
            raise ValueError(f"the state is {width} wide, this HyperConnection {self.norm.shape[0]}")
        if n is None:
            n = grouped_rms_norm(x, self.norm, c, self.eps)
        nw = n.to(self.down.dtype)
        if c & (c - 1) == 0:  # 1 / C in the GEMM's alpha: exact for a power of two, one launch fewer
            z = torch.addmm(nw.new_empty(()).expand(t, self.down.shape[0]), nw, self.down.t(), beta=0, alpha=1.0 / c)
        else:
            z = F.linear(nw, self.down) / c
        g = F.linear(F.silu(z), self.up)
        return hc_mix(g, n, c), n

    def write(self, y: torch.Tensor, x: torch.Tensor, n: torch.Tensor, next_hc: HyperConnection | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output y [T, D] added to every stream of x [T, C*D] (the state before the read
        that gave n), stream k scaled by 2 sigmoid(W_inject n / C)_k; returns [T, C*D], or with next_hc
        (the next read) also its normalised streams, for `next_hc.read(x, n)`."""
        if self.inject is None:
            raise ValueError("the final HyperConnection has no write")
        return hc_write(x, y, n, self.inject, self.streams, None if next_hc is None else next_hc.norm, self.eps)
