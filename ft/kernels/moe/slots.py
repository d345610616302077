"""The slot pool the MoE kernels read, and what they assume of it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ft.kernels.options import kernel_options


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


# tokens per grouped pass: an option, `ft.kernels.options.MoeOptions.grouped_max_tokens`


def moe_workspace_bytes(tokens: int, top_k: int, hidden: int, intermediate: int, elem_bytes: int = 2) -> int:
    """Bytes the Triton MoE allocates for a forward of `tokens` tokens at most: the per-pair
    intermediate h and per-pair outputs, in the activations' dtype (`elem_bytes`) on the grouped
    path, in fp32 on the per-pair path (at most `PER_PAIR_MAX_TOKENS` tokens); the larger of the
    two. The engine adds it to its activation reserve."""
    per_pair = top_k * (intermediate + hidden)
    return max(min(tokens, kernel_options().moe.grouped_max_tokens) * per_pair * elem_bytes, min(tokens, PER_PAIR_MAX_TOKENS) * per_pair * 4)


def moe_pools_workspace_bytes(tokens: int, top_k: int, hidden: int, intermediate: int, elem_bytes: int = 2) -> int:
    """Bytes `moe_over_pools`'s Triton path allocates for a chunk of `tokens` tokens: the per-pair
    outputs of the whole chunk (the passes fill them in turn; one sum at the end) and one token
    slice's intermediate h, in the activations' dtype (`elem_bytes`)."""
    return tokens * top_k * hidden * elem_bytes + min(tokens, kernel_options().moe.grouped_max_tokens) * top_k * intermediate * elem_bytes


PER_PAIR_MAX_TOKENS = 128
"""The per-pair (decode) MoE path's largest token count (`kernel.GROUPED_MIN_TOKENS`,
`DECODE_MAX_TOKENS`): its fp32 workspace is bounded by it."""

GROUPED_SHORT_TOKENS = 2048
"""Grouped passes of at most this many tokens take `grouped_kernel.GROUPED_CONFIG_SHORT`, longer ones
`GROUPED_CONFIG` (another compiled kernel each: the warm-up runs a prompt in each class). Measured at
1,024 and 4,096 tokens only; the switch between them is not measured."""


def check_slots(topk_slots: torch.Tensor, num_slots: int) -> None:
    """Raise ValueError unless every entry is -1 (skip) or a slot in [0, num_slots) (syncs the device)."""
    bad = (topk_slots < -1) | (topk_slots >= num_slots)
    if bool(bad.any()):
        raise ValueError(f"slot {int(topk_slots[bad][0])} is not -1 or a slot of a pool of {num_slots}")
