"""The decode MoE's tile sizes that callers size buffers by (details module of `ft.kernels.moe`; no triton
import, so the model layer may read them): the fewest rows a program of the per-pair down pass may take, and
the counters its sum by the last program needs."""

from __future__ import annotations

__all__ = ["DECODE_DOWN_MIN_BLOCK_H", "sum_counters_needed"]

DECODE_DOWN_MIN_BLOCK_H = 16
"""The fewest rows of the down projection a program of the decode MoE's per-pair down pass may compute
(`MoeOptions.decode_down_rows` and the one-token tiles are held to it): the sum counters are sized by it,
so that options changed after a model allocated its counters (a benchmark's variants) still find enough."""


def sum_counters_needed(tokens: int, hidden: int) -> int:
    """The int32 counters `moe_decode(sum_counters=...)` needs for up to `tokens` tokens of width `hidden`:
    one per token and column block of the per-pair down pass at its narrowest (`DECODE_DOWN_MIN_BLOCK_H`
    rows a block, whatever the options in force choose)."""
    return max(tokens, 1) * -(-hidden // DECODE_DOWN_MIN_BLOCK_H)
