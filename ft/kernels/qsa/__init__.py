"""QSA (Qwen3.8-Flash-Next's sparse attention) at decode: the indexer's block scores of each query over
its sequence's complete blocks, read from the raw indexer keys in the paged cache (`block_scores`),
and the tokens of its best blocks (`select_decode_tokens`: top-k with ties to the lower block).
`reference.py` holds their torch references, `kernel.py` the Triton kernels; these dispatch. Attention
over the chosen positions is `ft.kernels.attention.sparse_decode_attention`."""

from __future__ import annotations

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.qsa.reference import block_scores_ref, select_decode_tokens_ref

__all__ = ["block_scores", "block_scores_ref", "select_decode_tokens", "select_decode_tokens_ref"]


def block_scores(index_q: torch.Tensor, index_keys: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                 k_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor, rope_scale: float, ratio: int,
                 max_blocks: int, dense_blocks: int = 0) -> torch.Tensor:
    """[B, max_blocks] float32 block scores (`block_scores_ref`'s contract): the Triton kernel where
    Triton runs, else the reference."""
    if uses_triton(index_q.device):
        from ft.kernels.qsa.kernel import block_scores_triton  # NOTE: imports triton only when used

        return block_scores_triton(index_q, index_keys, page_table, seq_lens, k_norm, eps, inv_freq, rope_scale,
                                   ratio, max_blocks, dense_blocks)
    return block_scores_ref(index_q, index_keys, page_table, seq_lens, k_norm, eps, inv_freq, rope_scale, ratio,
                            max_blocks, dense_blocks)


def select_decode_tokens(scores: torch.Tensor, seq_lens: torch.Tensor, budget_blocks: int, ratio: int) -> torch.Tensor:
    """[B, budget_blocks * ratio + ratio - 1] int64 token positions (`select_decode_tokens_ref`'s
    contract): the Triton kernel where Triton runs, else the reference. Fixed shapes, no host read."""
    if uses_triton(scores.device):
        from ft.kernels.qsa.kernel import select_decode_tokens_triton  # NOTE: imports triton only when used

        return select_decode_tokens_triton(scores, seq_lens, budget_blocks, ratio)
    return select_decode_tokens_ref(scores, seq_lens, budget_blocks, ratio)
