"""The gated delta rule (Gated DeltaNet's linear attention): recurrent and chunked torch references
(also over packed sequences) and the whole decode step in `reference.py`, the decode step's Triton
kernels in `kernel.py` (two launches per layer and batch), the chunked prefill's over packed
sequences in `chunk_kernel.py` (two launches per layer and batch), and the dispatchers.

The decode dispatcher takes the sequences' state slots as a device tensor and allocates by shape
only, so a decode step on CUDA is capturable in a CUDA graph."""

from __future__ import annotations

import torch

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.dense import dense_linear
from ft.kernels.options import kernel_options
from ft.kernels.gated_delta.reference import (
    chunk_gated_delta_rule_ref,
    chunk_gated_delta_rule_varlen_ref,
    gated_delta_decode_ref,
    recurrent_gated_delta_rule_ref,
)

__all__ = [
    "chunk_gated_delta_rule_ref", "chunk_gated_delta_rule_varlen", "chunk_gated_delta_rule_varlen_ref",
    "gated_delta_decode", "gated_delta_decode_ref", "gated_delta_rule", "recurrent_gated_delta_rule_ref",
]


def _chunk_triton_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the chunked Triton kernels run for these tensors (else the references)."""
    if not (uses_triton(q.device) and q.dtype in TRITON_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype):
        return False
    from ft.kernels.gated_delta import chunk_kernel  # NOTE: imports triton only when used

    return q.shape[-1] <= chunk_kernel.MAX_DK and v.shape[-1] <= chunk_kernel.MAX_DK


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a batch of sequences of equal length; the contract of
    `recurrent_gated_delta_rule_ref` (q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], state
    [B, Hv, Dk, Dv] float32, not modified -> (o [B, T, Hv, Dv], new state [B, Hv, Dk, Dv] float32)),
    o in v's dtype on the Triton path, fp32 on the references'.

    Dispatcher: the chunked Triton kernels (`chunk_kernel`, on the batch packed along T with the state
    copied) where `uses_triton` says so; else one token per sequence runs the recurrent reference,
    longer runs the chunked reference.
    """
    if _chunk_triton_takes(q, k, v):
        from ft.kernels.gated_delta import chunk_kernel

        bsz, t = q.shape[:2]
        new_state = state.float().clone()
        cu = torch.arange(0, (bsz + 1) * t, t, dtype=torch.int32, device=q.device)
        slots = torch.arange(bsz, dtype=torch.int32, device=q.device)
        o = chunk_kernel.chunk_gated_delta_rule_varlen_triton(
            q.reshape(bsz * t, *q.shape[2:]), k.reshape(bsz * t, *k.shape[2:]), v.reshape(bsz * t, *v.shape[2:]),
            g.reshape(bsz * t, -1), beta.reshape(bsz * t, -1), new_state, cu, slots)
        return o.view(v.shape), new_state
    if q.shape[1] == 1:
        return recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, state)


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gated delta rule over sequences packed along T (prefill), states in a pool at slots.

    Args:
        q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (one dtype); g (log decay), beta: [T, Hv].
        ssm_state: [S, Hv, Dk, Dv] float32 (any strides): sequence b's state at slots[b], read as the
            state before its first token and replaced in place by the state after its last.
        cu_seqlens: [B+1] int32/int64 on q's device (sequence b is tokens cu[b]:cu[b+1]); slots: [B]
            int32/int64 on q's device, distinct.
        out: optional o [T, Hv, Dv] in v's dtype, unit stride along Dv; rows past cu_seqlens[-1] are
            left as they are (a padded batch).
    Returns:
        o [T, Hv, Dv] in v's dtype.

    Dispatcher: `chunk_kernel.chunk_gated_delta_rule_varlen_triton` (two launches, no host sync) where
    `uses_triton` says so and the head dims are at most its MAX_DK, else
    `chunk_gated_delta_rule_varlen_ref` (a loop over the sequences).
    """
    if _chunk_triton_takes(q, k, v):
        from ft.kernels.gated_delta import chunk_kernel

        return chunk_kernel.chunk_gated_delta_rule_varlen_triton(q, k, v, g, beta, ssm_state, cu_seqlens, slots, out)
    return chunk_gated_delta_rule_varlen_ref(q, k, v, g, beta, ssm_state, cu_seqlens, slots, out)


def _split_ba(h: torch.Tensor, w_ba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """b, a [B, Hv]: the two halves of dense_linear(h, w_ba) (views)."""
    ba = dense_linear(h, w_ba)
    hv = w_ba.shape[0] // 2
    return ba[:, :hv], ba[:, hv:]


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
    ba_proj: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        ba_proj: (h [B, H], w_ba [2 Hv, H]) dense, in place of b and a (pass None for both): b, a =
            dense_linear(h, w_ba) split in two (b's rows first); on the Triton path computed inside
            the conv launch where the kernel takes them and `GatedDeltaOptions.decode_ba_in_conv` is on
            (one launch fewer than the projection's own).
    Returns:
        o [B, Hv, Dv] in mixed's dtype.

    Dispatcher: the Triton kernels (`kernel.gated_delta_decode_triton`, two launches) where `uses_triton`
    says so and Dk <= 256, else `gated_delta_decode_ref`. Nothing here syncs with the host on CUDA.
    """
    if uses_triton(mixed.device) and mixed.dtype in TRITON_DTYPES:
        from ft.kernels.gated_delta import kernel  # NOTE: imports triton only when used

        if ssm_state.shape[2] <= kernel.MAX_DK:
            if ba_proj is not None and not (kernel_options().gated_delta.decode_ba_in_conv
                                            and kernel.ba_proj_fits(*ba_proj)):
                b, a, ba_proj = *_split_ba(*ba_proj), None
            return kernel.gated_delta_decode_triton(mixed, b, a, conv_state, ssm_state, weight, a_log, dt_bias, slots,
                                                    out=out, ba_proj=ba_proj)
    if ba_proj is not None:
        b, a = _split_ba(*ba_proj)
    o = gated_delta_decode_ref(mixed, b, a, conv_state, ssm_state, weight, a_log, dt_bias, slots)
    return o if out is None else out.copy_(o)
