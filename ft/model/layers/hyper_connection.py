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

from dataclasses import dataclass, field

import torch

from ft.kernels.hyper_connection import grouped_rms_norm, hc_read, hc_write, hc_write_read

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
    computed), then `hc_read`: one GEMM of the normalised streams by down and inject together (`mix_in`,
    their rows stacked once at construction; down and inject become views of it; the 1 / C in the
    GEMM's alpha), a SiLU, the up GEMM and one launch for the gated mean; the write is one launch that
    also computes the next read's norm, from the inject logits its read computed; a write and the read
    after it at one token (`write_read`) are the read's two launches, the write folded into the first."""

    norm: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    inject: torch.Tensor | None
    streams: int
    eps: float = 1e-6
    mix_in: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts = [self.down] if self.inject is None else [self.down, self.inject.to(self.down.dtype)]
        mix_in = torch.cat(parts) if len(parts) > 1 else self.down
        rank = self.down.shape[0]
        object.__setattr__(self, "mix_in", mix_in)
        object.__setattr__(self, "down", mix_in[:rank])
        if self.inject is not None:
            object.__setattr__(self, "inject", mix_in[rank:])

    def read(self, x: torch.Tensor, n: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, C*D] -> (u [T, D] the block's input, the write's gate logits [T, C] = inject N / C, or
        None for the final read); n: the normalised streams N when the previous write computed them
        (`write(..., next_hc=self)`)."""
        width = x.shape[1]
        c = self.streams
        if width != self.norm.shape[0]:
            raise ValueError(f"the state is {width} wide, this HyperConnection {self.norm.shape[0]}")
        if n is None:
            n = grouped_rms_norm(x, self.norm, c, self.eps)
        return hc_read(n, self.mix_in, self.up, self.down.shape[0], c)

    def write(self, y: torch.Tensor, x: torch.Tensor, gate_logits: torch.Tensor, next_hc: HyperConnection | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output y [T, D] added to every stream of x [T, C*D] (the state before the read),
        stream k scaled by 2 sigmoid(gate_logits[:, k]) (`read`'s second result: inject N / C); returns
        [T, C*D], or with next_hc (the next read) also its normalised streams, for `next_hc.read(x, n)`."""
        if self.inject is None:
            raise ValueError("the final HyperConnection has no write")
        return hc_write(x, y, gate_logits, self.streams, None if next_hc is None else next_hc.norm, self.eps)

    def write_read(self, y: torch.Tensor, x: torch.Tensor, gate_logits: torch.Tensor, next_hc: HyperConnection
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`write(y, x, gate_logits, next_hc)` then `next_hc.read` of its result: (x' [T, C*D], the next
        block's input u [T, D], next_hc's gate logits [T, C] or None); at one token in two launches (the
        write folded into the read's first, `hc_write_read`)."""
        if self.inject is None:
            raise ValueError("the final HyperConnection has no write")
        if x.shape[1] != next_hc.norm.shape[0]:
            raise ValueError(f"the state is {x.shape[1]} wide, the next HyperConnection {next_hc.norm.shape[0]}")
        return hc_write_read(x, y, gate_logits, self.streams, next_hc.norm, self.eps, next_hc.mix_in, next_hc.up,
                             next_hc.down.shape[0])
