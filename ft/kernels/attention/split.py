"""Split-K of the paged decode attention: how many splits, and the workspace their partials go to.

No triton here: the caller (the model runner) sizes the workspace once, before it captures its
CUDA graphs, from values it declares (batch bucket, maximum context), never from the step's data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.kernels.options import kernel_options

SPLIT_MIN_TOKENS = 256
"""Tokens of the declared maximum context per split at least: shorter contexts run single-pass."""
# the split count's target programs and bound: `ft.kernels.options.DecodeAttentionOptions`


def decode_attention_splits(batch: int, num_kv_heads: int, max_seq_len: int, *, target_programs: int | None = None,
                            max_splits: int | None = None) -> int:
    """Split count of `paged_decode_attention` for a batch whose contexts are at most `max_seq_len` tokens.

    min(cdiv(max_seq_len, SPLIT_MIN_TOKENS), cdiv(target_programs, batch * num_kv_heads), max_splits),
    at least 1 (defaults `DecodeAttentionOptions.split_target_programs` and `.max_splits`; a kernel that fits more programs an
    SM passes its own); 1 means the single-pass kernel. It depends on declared sizes only, so
    a CUDA graph captured with it stays right for every step. The count changes speed, never the
    result's meaning: each program splits its sequence's actual length into that many chunks, so
    a sequence longer than `max_seq_len` is still attended in full.
    """
    by_len = -(-max(max_seq_len, 1) // SPLIT_MIN_TOKENS)
    opts = kernel_options().decode_attention
    by_programs = -(-(target_programs or opts.split_target_programs) // max(batch * num_kv_heads, 1))
    return max(1, min(by_len, by_programs, max_splits or opts.max_splits))


@dataclass(frozen=True)
class DecodeWorkspace:
    """Partial results of the split-K decode attention, fp32: row b * splits + s holds split s of sequence b.

    acc: [R, Hq, D] unnormalized sums of p * V; stats: [R, Hq, 2] the running max of the scores
    (log2 units, scale included) and the sum of exp2(score - max). A workspace of R rows serves
    every launch with batch * splits <= R, so one workspace (sized for the largest product over
    the graph buckets) serves every bucket and layer of a decode step.
    """

    acc: torch.Tensor
    stats: torch.Tensor

    @property
    def rows(self) -> int:
        return self.acc.shape[0]


def decode_attention_workspace(batch: int, num_q_heads: int, head_dim: int, splits: int,
                               device: torch.device | str) -> DecodeWorkspace:
    """A workspace for `batch` sequences of `splits` splits each (batch * splits rows)."""
    rows = batch * splits
    return DecodeWorkspace(torch.empty((rows, num_q_heads, head_dim), dtype=torch.float32, device=device),
                           torch.empty((rows, num_q_heads, 2), dtype=torch.float32, device=device))
