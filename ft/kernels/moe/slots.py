"""The slot pool the MoE kernels read, and what they assume of it."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SlotWeights(NamedTuple):
    """The slot pool of one expert cache.

    Dense: w13 [S, 2I, H] (gate rows then up rows), w2 [S, H, I], scales None.
    NVFP4: w13 uint8 [S, 2I, H/2], w13_scale e4m3 [S, 2I, H/16], w2 uint8 [S, H, I/2],
    w2_scale e4m3 [S, H, I/16], scale_2 float32 [S, 3] (gate, up, down global scales).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None

    @property
    def is_nvfp4(self) -> bool:
        return self.w13_scale is not None


GROUPED_MAX_TOKENS = 1024
"""The Triton MoE's grouped path takes at most this many tokens per pass (longer chunks are cut),
which bounds its fp32 workspace (`moe_workspace_bytes`)."""


def moe_workspace_bytes(tokens: int, top_k: int, hidden: int, intermediate: int) -> int:
    """Bytes the Triton MoE allocates for a forward of `tokens` tokens at most (its per-pair
    intermediate h and per-pair outputs, fp32): the engine adds it to its activation reserve."""
    return min(tokens, GROUPED_MAX_TOKENS) * top_k * (intermediate + hidden) * 4


def check_slots(topk_slots: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError unless every entry is -1 (skip) or a slot in [0, num_slots) (syncs the device)."""
    bad = (topk_slots < -1) | (topk_slots >= num_slots)
    if bool(bad.any()):
        raise ValueError(f"slot {int(topk_slots[bad][0])} is not -1 or a slot of a pool of {num_slots}")
