"""Qwen3.8-Flash-Next's HyperConnections on the hot path: the grouped RMSNorm of the C streams, the
read's gated mean (`hc_mix`) and the write's gated add fused with the next read's norm (`hc_write`,
its gates' logits from the read's GEMM).
`reference.py` holds the torch references (the model's math), `kernel.py` the Triton kernels; these
dispatch (Triton where it runs for the activation's dtype, else the reference). A read's two low-rank
projections (`hc_read`) are torch GEMMs (cuBLAS on a GPU) beside the mix kernel, or, for reads of at
most `HyperConnectionOptions.fused_read_max_tokens` tokens, two Triton kernels that do the whole read."""

from __future__ import annotations

import torch

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.hyper_connection.reference import (grouped_rms_norm_ref, hc_mix_ref, hc_read_lowrank_ref, hc_read_ref,
                                                   hc_write_read_ref, hc_write_ref)
from ft.kernels.options import kernel_options

__all__ = ["grouped_rms_norm", "grouped_rms_norm_ref", "hc_mix", "hc_mix_ref", "hc_read", "hc_read_ref", "hc_write",
           "hc_write_read", "hc_write_read_ref", "hc_write_ref"]

MAX_STREAM_WIDTH = 8192
"""Widest stream (D) the Triton kernels take in one tile; wider ones run the references."""


def _triton(x: torch.Tensor, width: int) -> bool:
    return uses_triton(x.device) and x.dtype in TRITON_DTYPES and x.dim() == 2 and 1 <= width <= MAX_STREAM_WIDTH


def grouped_rms_norm(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """x [..., groups * D] normalised per group (`grouped_rms_norm_ref`'s contract)."""
    if _triton(x, x.shape[-1] // groups):
        from ft.kernels.hyper_connection.kernel import grouped_rms_norm_triton  # NOTE: imports triton when used

        return grouped_rms_norm_triton(x, weight, groups, eps)
    return grouped_rms_norm_ref(x, weight, groups, eps)


def hc_mix(g: torch.Tensor, n: torch.Tensor, streams: int) -> torch.Tensor:
    """u [T, D] = mean over the streams of sigmoid(g_k) * n_k (`hc_mix_ref`'s contract)."""
    if _triton(n, n.shape[-1] // streams) and g.dtype in TRITON_DTYPES:
        from ft.kernels.hyper_connection.kernel import hc_mix_triton

        return hc_mix_triton(g, n, streams)
    return hc_mix_ref(g, n, streams)


def hc_write(x: torch.Tensor, y: torch.Tensor, gate_logits: torch.Tensor, streams: int,
             next_norm: torch.Tensor | None = None, eps: float = 1e-6
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x' = x_k + 2 sigmoid(gate_logits_k) y (and, with next_norm, the next read's normalised streams):
    `hc_write_ref`'s contract, one launch on Triton."""
    if _triton(x, x.shape[-1] // streams) and gate_logits.dtype in TRITON_DTYPES:
        from ft.kernels.hyper_connection.kernel import hc_write_triton

        return hc_write_triton(x, y, gate_logits, streams, next_norm, eps)
    return hc_write_ref(x, y, gate_logits, streams, next_norm, eps)


def hc_read(n: torch.Tensor, mix_in: torch.Tensor, up: torch.Tensor, rank: int, streams: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A read after its norm: (u [T, D], the write's gate logits [T, C] or None for the final read)
    (`hc_read_ref`'s contract: n [T, C*D] normalised streams, mix_in [rank (+ C), C*D], up [C*D, rank]):
    the reference's GEMMs, then `hc_mix`; short reads (`HyperConnectionOptions.fused_read_max_tokens`)
    in two Triton launches."""
    if (n.shape[0] <= kernel_options().hyper_connection.fused_read_max_tokens and streams & (streams - 1) == 0
            and _triton(n, n.shape[-1] // streams)
            and mix_in.dtype in TRITON_DTYPES and up.dtype == mix_in.dtype):
        from ft.kernels.hyper_connection.kernel import hc_read_triton

        return hc_read_triton(n, mix_in, up, rank, streams)
    g, gate_logits = hc_read_lowrank_ref(n, mix_in, up, rank, streams)
    return hc_mix(g, n, streams), (gate_logits if mix_in.shape[0] > rank else None)


def hc_write_read(x: torch.Tensor, y: torch.Tensor, gate_logits: torch.Tensor, streams: int, next_norm: torch.Tensor,
                  eps: float, mix_in: torch.Tensor, up: torch.Tensor, rank: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A write and the next read (`hc_write_read_ref`'s contract): in two Triton launches where the next read
    takes the form "fma" (`HyperConnectionOptions.fma_read_max_tokens`) and `write_into_read` is on (the
    write folded into the read's first projection, `kernel.hc_write_read_triton`), else `hc_write` with
    the next norm then `hc_read` (three or four launches)."""
    opts = kernel_options().hyper_connection
    t, width = x.shape
    d = width // streams
    if (opts.write_into_read and t <= min(opts.fma_read_max_tokens, opts.fused_read_max_tokens)
            and streams & (streams - 1) == 0 and _triton(x, d) and gate_logits.dtype in TRITON_DTYPES
            and mix_in.dtype in TRITON_DTYPES and up.dtype == mix_in.dtype and y.shape == (t, d)):
        from ft.kernels.hyper_connection.kernel import hc_write_read_triton

        return hc_write_read_triton(x, y, gate_logits, streams, next_norm, eps, mix_in, up, rank)
    out, n = hc_write(x, y, gate_logits, streams, next_norm, eps)
    u, next_gates = hc_read(n, mix_in, up, rank, streams)
    return out, u, next_gates
