"""The token embedding's lookup, from device memory or from pinned host memory.

With `EngineConfig.embedding_host` the table (vocabulary x hidden) stays in host memory and each step
reads only its tokens' rows: T x hidden values (5 KiB a token at 2,560 bf16), gathered by the device
from the pinned table inside the step (`ft.kernels.host_gather.gather_rows`, the n-gram table's
gather), so the card's bytes go to expert slots instead.
"""

from __future__ import annotations

import torch

from ft.kernels.host_gather import gather_rows

__all__ = ["embed_tokens"]


def embed_tokens(table: torch.Tensor, ids: torch.Tensor, on_host: bool, dtype: torch.dtype) -> torch.Tensor:
    """ids [T] int64 on the compute device -> [T, H] rows of `table` [V, H]: indexed where the table
    is on the device, gathered from host memory when `on_host` (pinned on CUDA), cast to `dtype`
    (the loader keeps the table in the compute dtype: the same values either way)."""
    if not on_host:
        return table[ids]
    return gather_rows(table, ids.reshape(-1, 1).to(torch.int64), dtype)
