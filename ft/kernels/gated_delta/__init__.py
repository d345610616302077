"""The gated delta rule (Gated DeltaNet's linear attention): recurrent and chunked torch references
and the whole decode step in `reference.py`, the decode step's Triton kernels in `kernel.py` (two
launches per layer and batch), and the dispatchers.

The decode dispatcher takes the sequences' state slots as a device tensor and allocates by shape
only, so a decode step on CUDA is capturable in a CUDA graph."""

from __future__ import annotations

import torch

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.gated_delta.reference import (
    chunk_gated_delta_rule_ref,
    gated_delta_decode_ref,
    recurrent_gated_delta_rule_ref,
)

__all__ = [
    "chunk_gated_delta_rule_ref", "gated_delta_decode", "gated_delta_decode_ref", "gated_delta_rule",
    "recurrent_gated_delta_rule_ref",
]


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: one token per sequence runs the recurrent form, longer runs the chunked form."""
    if q.shape[1] == 1:
        return recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, state)


def gated_delta_decode(
    mixed: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    weight: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    slots: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One Gated DeltaNet decode step (conv with its rolling state, gates, one recurrent step) for a
    batch of one new token per sequence; the states at slots are updated in place.

    Args:
        mixed: [B, C] q, k, v channels before the conv, C = 2 * Hk * Dk + Hv * Dv (q of every key
            head, then k, then v; Hk is read from the shapes).
        b, a: [B, Hv]; weight: [C, W] the conv weight; a_log, dt_bias: [Hv].
        conv_state: [S, C, W-1] in mixed's dtype, ssm_state: [S, Hv, Dk, Dv] float32: the layer's
            views of the mamba pool (any strides).
        slots: [B] int32/int64 device tensor, distinct; a negative slot (padding row) reads and
            writes no state and gives zeros.
        out: optional output [B, Hv, Dv].
    Returns:
        o [B, Hv, Dv] in mixed's dtype.

    Dispatcher: the Triton kernels (`kernel.gated_delta_decode_triton`, two launches) where `uses_triton`
    says so and Dk <= 256, else `gated_delta_decode_ref`. Nothing here syncs with the host on CUDA.
    """
    if uses_triton(mixed.device) and mixed.dtype in TRITON_DTYPES:
        from ft.kernels.gated_delta import kernel  # NOTE: imports triton only when used

        if ssm_state.shape[2] <= kernel.MAX_DK:
            return kernel.gated_delta_decode_triton(mixed, b, a, conv_state, ssm_state, weight, a_log, dt_bias, slots,
                                                    out=out)
    o = gated_delta_decode_ref(mixed, b, a, conv_state, ssm_state, weight, a_log, dt_bias, slots)
    return o if out is None else out.copy_(o)
