"""Torch reference of QSA's block scores over the paged cache (`ft.kernels.qsa`)."""

from __future__ import annotations

import math

import torch


def block_scores_ref(index_q: torch.Tensor, index_keys: torch.Tensor, page_table: torch.Tensor,
                     seq_lens: torch.Tensor, k_norm: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                     rope_scale: float, ratio: int, max_blocks: int) -> torch.Tensor:
    """Each decode query's score for every complete block of its sequence.

    Args:
        index_q: [B, Hi, Di] the indexer queries (normed and rotated) of the sequences' last positions.
        index_keys: [P, page_size, Di] one layer's raw indexer keys (`KVPool.index_layer`); page_size a
            multiple of ratio.
        page_table: [B, max_pages] int64; seq_lens: [B] tokens of each sequence (its query included).
        k_norm: [Di] the key RMSNorm's weight (applied as 1 + w); inv_freq: [rot / 2] float32 and
            rope_scale: the rotation of the first rot features, at each block's first position.
        max_blocks: the width of the result (at least every sequence's complete blocks).
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
    return scores.masked_fill(~valid, float("-inf"))
