"""Qwen3.8-Flash-Next's Engram (PLE layer) at a decode step: one new token per row, its n-gram
context and conv history at its mamba slot. `ngram_rows_decode` hashes each row's n-grams into its
table rows and moves the context on; `ple_decode` adds the PLE delta to the streams and moves the
history on. The Triton kernels (`kernel.py`: three launches where the batched torch forms of
`ft.model.layers.engram` take ~130 small ones) where Triton runs, else the references
(`reference.py`, the contract). Rows with slot -1 (padding) read empty states and write none.
`ple_prefill` is the PLE over a prefill's packed tokens (its reference: the decode step token by token)."""

from __future__ import annotations

import torch

from ft.kernels.backend import TRITON_DTYPES, uses_triton
from ft.kernels.options import kernel_options
from ft.kernels.engram.reference import ngram_rows_decode_ref, ple_decode_ref, ple_prefill_ref

__all__ = ["ngram_rows_decode", "ngram_rows_decode_ref", "ple_decode", "ple_decode_ref", "ple_prefill",
           "ple_prefill_on_triton", "ple_prefill_ref", "ple_prefill_runs_triton"]


def ngram_rows_decode(ids: torch.Tensor, contexts: torch.Tensor, slots: torch.Tensor, multipliers: tuple[int, ...],
                      sizes: torch.Tensor, offsets: torch.Tensor, heads_per_ngram: int, eos: int) -> torch.Tensor:
    """[B, H] int64 table rows of one new token per row; contexts[slot] moved on (`ngram_rows_decode_ref`)."""
    if uses_triton(ids.device) and contexts.shape[1] <= 3:
        from ft.kernels.engram.kernel import ngram_rows_decode_triton  # NOTE: imports triton only when used

        return ngram_rows_decode_triton(ids, contexts, slots, multipliers, sizes, offsets, heads_per_ngram, eos)
    return ngram_rows_decode_ref(ids, contexts, slots, multipliers, sizes, offsets, heads_per_ngram, eos)


def ple_decode(x: torch.Tensor, key_value: torch.Tensor, histories: torch.Tensor, slots: torch.Tensor,
               norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, conv: torch.Tensor,
               streams: int, dilation: int, eps: float) -> torch.Tensor:
    """x + the PLE delta [B, C*D]; histories[slot] moved on (`ple_decode_ref`)."""
    if uses_triton(x.device) and x.dtype in TRITON_DTYPES and x.shape[1] // streams <= 8192:
        from ft.kernels.engram.kernel import ple_decode_triton  # NOTE: imports triton only when used

        return ple_decode_triton(x, key_value, histories, slots, norm_key, norm_query, norm_conv, conv, streams,
                                 dilation, eps)
    return ple_decode_ref(x, key_value, histories, slots, norm_key, norm_query, norm_conv, conv, streams, dilation,
                          eps)


def ple_prefill_on_triton(x: torch.Tensor, streams: int) -> bool:
    """Whether the model's prefill takes `ple_prefill`'s Triton kernels for streams x [T, C*D]
    (`EngramOptions.prefill_triton`, off until run on a GPU) rather than its batched torch form."""
    return kernel_options().engram.prefill_triton and ple_prefill_runs_triton(x, streams)


def ple_prefill_runs_triton(x: torch.Tensor, streams: int) -> bool:
    """Whether `ple_prefill` runs its Triton kernels for streams x [T, C*D] (else its reference: a loop over the
    tokens, for tests)."""
    return uses_triton(x.device) and x.dtype in TRITON_DTYPES and x.shape[1] // streams <= 8192


def ple_prefill(x: torch.Tensor, key_value: torch.Tensor, histories: torch.Tensor, cu_seqlens: torch.Tensor,
                norm_key: torch.Tensor, norm_query: torch.Tensor, norm_conv: torch.Tensor, conv: torch.Tensor,
                streams: int, dilation: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + the PLE delta [T, C*D], the histories after each sequence [B, hist, C*D]) of a prefill's packed
    tokens (`ple_prefill_ref`)."""
    if ple_prefill_runs_triton(x, streams):
        from ft.kernels.engram.kernel import ple_prefill_triton  # NOTE: imports triton only when used

        return ple_prefill_triton(x, key_value, histories, cu_seqlens, norm_key, norm_query, norm_conv, conv, streams,
                                  dilation, eps)
    return ple_prefill_ref(x, key_value, histories, cu_seqlens, norm_key, norm_query, norm_conv, conv, streams,
                           dilation, eps)
