"""Torch references of QSA's decode kernels (`ft.kernels.qsa`): the block scores over the paged cache and
the selection of each query's tokens from them."""

from __future__ import annotations

import math

import torch


def block_scores_ref(index_q: torch.Tensor, index_keys: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, k_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                     rope_scale: float, ratio: int, max_blocks: int, dense_blocks: int = 0) -> torch.Tensor:
    """Each decode query's score for every complete block of its sequence.

    Args:
        index_q: [B, Hi, Di] the indexer queries (normed and rotated) of the sequences' last positions.
        index_keys: [P, page_size, Di] one layer's raw indexer keys (`KVPool.index_layer`); page_size a
            multiple of ratio.
        page_table: [B, max_pages] int64; seq_lens: [B] tokens of each sequence (its query included).
        k_norm: [Di] the key RMSNorm's weight (applied as 1 + w); inv_freq: [rot / 2] float32 and
            rope_scale: the rotation of the first rot features, at each block's first position.
        max_blocks: the width of the result (at least every sequence's complete blocks).
        dense_blocks: a sequence with at most this many complete blocks scores each of them 0 (the
            selection's budget: inside it every complete block is taken whatever its score, so no key
            needs reading); 0: every sequence is scored.
    Returns:
        [B, max_blocks] float32: sum over heads of ReLU(q . K_j) / sqrt(Di), K_j block j's key (the fp32
        mean of its raw keys, normed, rotated); -inf for blocks that are not complete.
    """
    b, hi, di = index_q.shape
    page = index_keys.shape[1]
    j = torch.arange(max_blocks, device=index_q.device)
    visible = torch.div(seq_lens.to(torch.int64), ratio, rounding_mode="floor")  # [B]
    pos = j[:, None] * ratio + torch.arange(ratio, device=j.device)  # [J, ratio]
    valid = j[None, :] < visible[:, None]  # [B, J]
    pidx = torch.where(valid[:, :, None], pos[None] // page, 0).clamp(max=page_table.shape[1] - 1)
    raw = index_keys[page_table.gather(1, pidx.reshape(b, -1)).reshape(b, max_blocks, ratio), pos[None] % page]
    mean = raw.float().mean(2)  # [B, J, Di]
    normed = mean * torch.rsqrt(mean.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + k_norm.float())
    rot, half = 2 * inv_freq.shape[0], inv_freq.shape[0]
    ang = (j * ratio).float()[:, None] * inv_freq.float()[None, :]  # [J, half]
    cos, sin = ang.cos() * rope_scale, ang.sin() * rope_scale
    x1, x2 = normed[..., :half], normed[..., half:rot]
    keys = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, normed[..., rot:]], dim=-1)
    scores = torch.relu(torch.einsum("bhd,bjd->bhj", index_q.float(), keys)).sum(1) / math.sqrt(di)
    scores = torch.where((visible <= dense_blocks)[:, None], 0.0, scores)
    return scores.masked_fill(~valid, float("-inf"))


def select_decode_tokens_ref(scores: torch.Tensor, seq_lens: torch.Tensor, budget_blocks: int,
                             ratio: int) -> torch.Tensor:
    """The tokens one decode query per sequence attends to, from its block scores.

    Args:
        scores: [B, J] float32 (`block_scores_ref`: >= 0 for complete blocks, -inf past them).
        seq_lens: [B] tokens of each sequence, its query (at seq_lens - 1) included.
    Returns:
        [B, budget_blocks * ratio + ratio - 1] int64: the tokens of the `budget_blocks` best complete
        blocks (every complete block while they fit; among equal scores the lower block wins) in
        ascending order, -1 after them up to budget_blocks * ratio entries, then the tokens of the
        query's incomplete block (-1 where it has fewer than ratio - 1). The same set as
        `ft.model.layers.qsa.select_tokens` gives that query (which orders it best first).

    The top-k runs on int64 keys (the score's bits, then the block's distance from the last block), so
    that among equal scores the lower block wins whatever order torch.topk keeps."""
    b, j_count = scores.shape
    dev = scores.device
    blocks = torch.arange(j_count, device=dev)
    bits = (scores.float() + 0.0).contiguous().view(torch.int32).to(torch.int64)  # (+ 0.0: no -0.0) >= 0 and rising
    keys = torch.where(torch.isfinite(scores), (bits << 32) | (j_count - 1 - blocks), -1)
    k = min(budget_blocks, j_count)
    top = torch.topk(keys, k, dim=1).values  # [B, k], best first
    chosen = torch.where(top >= 0, j_count - 1 - (top & 0xFFFFFFFF), j_count)
    chosen = torch.sort(chosen, dim=1).values  # ascending, the unused (j_count) last
    if k < budget_blocks:
        chosen = torch.cat([chosen, chosen.new_full((b, budget_blocks - k), j_count)], dim=1)
    tokens = chosen[:, :, None] * ratio + torch.arange(ratio, device=dev)
    tokens = torch.where((chosen < j_count)[:, :, None], tokens, -1).reshape(b, budget_blocks * ratio)
    last = seq_lens.to(torch.int64) - 1
    tail = torch.div(last + 1, ratio, rounding_mode="floor")[:, None] * ratio + torch.arange(ratio - 1, device=dev)
    return torch.cat([tokens, torch.where(tail <= last[:, None], tail, -1)], dim=1)
