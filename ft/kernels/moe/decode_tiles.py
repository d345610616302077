"""The decode MoE's tile sizes that callers size buffers by (details module of `ft.kernels.moe`; no triton
import, so the model layer may read them): the per-pair down pass's rows a program, and the counters its
sum by the last program needs."""

from __future__ import annotations

from ft.kernels.options import kernel_options

__all__ = ["DECODE_DOWN_BLOCK_H", "sum_counters_needed"]

DECODE_DOWN_BLOCK_H = 64
"""Rows of the down projection a program of the decode MoE's per-pair down pass computes (its sweep's best,
`decode_kernel.down_pairs_config`)."""


def sum_counters_needed(tokens: int, hidden: int) -> int:
    """The int32 counters `moe_decode(sum_counters=...)` needs for up to `tokens` tokens of width `hidden`
    (one per token and column block of the per-pair down pass; one token's blocks are
    `MoeOptions.decode_tiles_one_token`'s, narrower, where the options in force set them)."""
    one_token = kernel_options().moe.decode_tiles_one_token
    one_token_blocks = -(-hidden // one_token[1][0]) if one_token and tokens >= 1 else 0
    return max(tokens * -(-hidden // DECODE_DOWN_BLOCK_H), one_token_blocks)
