"""Qwen3.8-Flash-Next's QSA sparse attention, torch reference: the indexer's compressed keys, the
per-query token selection, and attention over the selected tokens.

An indexer (4 query heads and one key head of 128) scores blocks of `ratio` (4) consecutive tokens:
a block's key is the fp32 mean of its tokens' raw keys (normed and rotated afterwards, at the block's
first position), a query's score for it is the sum over heads of ReLU(q . K) / sqrt(D). Query t sees
the complete blocks 0 .. V-1, V = (t + 1) // ratio; it attends to the tokens of the best `budget`
blocks (all of them while V <= budget: plain causal attention) and to the 0..ratio-1 tokens of its
own incomplete block, which are always taken. One token set per query serves every head.
docs/qwen3.8-flash-next/qsa-engram.md, part A, is the specification, with its sources.

Ties (common: ReLU maps every block that all heads dislike to exactly 0) go to the lower block: the
reference leaves their order undefined, so parity on exact ties cannot be promised by anyone.
"""

from __future__ import annotations

import math

import torch

__all__ = ["compress_keys", "select_tokens", "selection_scores", "sparse_attention"]


def compress_keys(raw_keys: torch.Tensor, ratio: int) -> torch.Tensor:
    """raw_keys [L, D] (one sequence's indexer keys, before norm and RoPE) -> [L // ratio, D]: each
    complete block's fp32 mean, in raw_keys' dtype. A trailing partial block has no key yet."""
    blocks = raw_keys.shape[0] // ratio
    return raw_keys[: blocks * ratio].float().reshape(blocks, ratio, raw_keys.shape[-1]).mean(1).to(raw_keys.dtype)


def selection_scores(index_q: torch.Tensor, block_keys: torch.Tensor, positions: torch.Tensor, ratio: int
                     ) -> torch.Tensor:
    """[T, P] float32: each query's score for each block, the sum over the indexer heads of
    ReLU(q . K_j) / sqrt(D), -inf for the blocks a query does not see (not complete at its position).
    Arguments as `select_tokens`'; raises ValueError when P does not cover every query's complete blocks."""
    t_count, d = index_q.shape[0], index_q.shape[-1]
    visible = torch.div(positions + 1, ratio, rounding_mode="floor")  # [T]
    p = block_keys.shape[0]
    if t_count and p < int(visible.max()):
        raise ValueError(f"{p} compressed keys, a query at position {int(positions.max())} sees {int(visible.max())}")
    scores = torch.relu(torch.einsum("thd,pd->thp", index_q.float(), block_keys.float())).sum(1) / math.sqrt(d)
    blocks = torch.arange(p, device=index_q.device)
    return scores.masked_fill(blocks[None, :] >= visible[:, None], float("-inf"))


def select_tokens(index_q: torch.Tensor, block_keys: torch.Tensor, positions: torch.Tensor, budget_blocks: int,
                  ratio: int) -> torch.Tensor:
    """The tokens each query attends to.

    Args:
        index_q: [T, H_I, D] the indexer queries (normed and rotated) at `positions`.
        block_keys: [P, D] the sequence's compressed keys (normed and rotated); P covers the complete
            blocks of the last position (blocks past a query's own are never looked at).
        positions: [T] int64 each query's position in its sequence (0-based).
    Returns:
        [T, budget_blocks * ratio + ratio - 1] int64 token positions, -1 where unused: the chosen
        blocks' tokens (best first, ties to the lower block; ascending while every visible block fits),
        then the query's incomplete block's tokens.
    """
    t_count = index_q.shape[0]
    dev = index_q.device
    visible = torch.div(positions + 1, ratio, rounding_mode="floor")  # [T]
    scores = selection_scores(index_q, block_keys, positions, ratio)
    # the stable descending sort keeps equal scores in block order; while every visible block fits
    # the budget, they all come first (the rest are -inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :budget_blocks]  # [T, <=budget]
    if order.shape[1] < budget_blocks:
        order = torch.cat([order, order.new_zeros(t_count, budget_blocks - order.shape[1])], dim=1)
    taken = torch.arange(budget_blocks, device=dev)[None, :] < torch.clamp(visible, max=budget_blocks)[:, None]
    within = torch.arange(ratio, device=dev)
    chosen = (order[:, :, None] * ratio + within).reshape(t_count, -1)
    chosen = torch.where(taken.repeat_interleave(ratio, dim=1), chosen, torch.full_like(chosen, -1))
    tail = visible[:, None] * ratio + torch.arange(ratio - 1, device=dev)[None, :]
    tail = torch.where(tail <= positions[:, None], tail, torch.full_like(tail, -1))
    return torch.cat([chosen, tail], dim=1)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of each query over its selected tokens only.

    q [T, Hq, D]; k, v [L, Hkv, D] the sequence's keys (rotated) and values; tokens [T, W] positions
    into k, v (-1: unused), from `select_tokens`; query head h reads kv head h // (Hq / Hkv). Scores,
    softmax and the weighted sum in fp32; returns [T, Hq, D] in q's dtype."""
    t_count, hq, d = q.shape
    hkv = k.shape[1]
    valid = tokens >= 0  # [T, W]
    idx = tokens.clamp(min=0)
    ks = k.float()[idx]  # [T, W, Hkv, D]
    vs = v.float()[idx]
    qg = q.float().reshape(t_count, hkv, hq // hkv, d)
    s = torch.einsum("tgrd,twgd->tgrw", qg, ks) * scale
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("tgrw,twgd->tgrd", torch.softmax(s, dim=-1), vs)
    return out.reshape(t_count, hq, d).to(q.dtype)
