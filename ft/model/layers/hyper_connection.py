"""Qwen3.8-Flash-Next's HyperConnections, torch reference.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.kernels.norm import rms_norm_ref

__all__ = ["HyperConnection", "expand_streams", "grouped_rms_norm"]


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """x [..., groups * D] normalised per group of D in fp32, times (1 + weight [groups * D]), in x's dtype:
    Qwen3-Next's zero-centred RMSNorm (`rms_norm_ref`) with a weight row per group."""
    shape = x.shape
    d = shape[-1] // groups
    return rms_norm_ref(x.reshape(*shape[:-1], groups, d), weight.reshape(groups, d), eps).reshape(shape)


def expand_streams(embedding: torch.Tensor, streams: int) -> torch.Tensor:
    """[T, D] -> [T, streams * D]: the embedding copied into every stream (no scale, no parameters)."""
    return embedding.repeat(1, streams)


@dataclass(frozen=True)
class HyperConnection:
    """One HyperConnection module's tensors (checkpoint names under `...{attn,mlp}_hyper_connection.`
    or `hyper_connection_mixer.`): norm `hc_norm.weight` [C*D]; down `input_mix_weight_down.weight`
    [r, C*D]; up `input_mix_weight_up.weight` [C*D, r]; inject `block_inject_weight.weight` [C, C*D],
    None for the final read, which has no write."""

    norm: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    inject: torch.Tensor | None
    streams: int
    eps: float = 1e-6

    def read(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, C*D] -> (u [T, D] the block's input, N [T, C*D] the normalised streams for `write`)."""
        t, width = x.shape
        c = self.streams
        if width != self.norm.shape[0]:
            raise ValueError(f"the state is {width} wide, this HyperConnection {self.norm.shape[0]}")
        n = grouped_rms_norm(x, self.norm, c, self.eps)
        nw = n.to(self.down.dtype)
        gate = torch.sigmoid(F.linear(F.silu(F.linear(nw, self.down) / c), self.up))
        u = (gate * n).reshape(t, c, width // c).mean(dim=1)
        return u, n

    def write(self, y: torch.Tensor, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """The block's output y [T, D] added to every stream of x [T, C*D] (the state before the read
        that gave n), stream k scaled by 2 sigmoid(W_inject n / C)_k; returns [T, C*D]."""
        if self.inject is None:
            raise ValueError("the final HyperConnection has no write")
        t, width = x.shape
        c = self.streams
        a = 2.0 * torch.sigmoid(F.linear(n.to(self.inject.dtype), self.inject) / c)  # [T, C]
        out = x.reshape(t, c, width // c) + a[:, :, None].to(x.dtype) * y[:, None, :]
        return out.reshape(t, width)
