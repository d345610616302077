"""Tensors whose leading dimension grows or shrinks at its tail, keeping the rows below.

Every pool is row-major over its unit (page, slot), so a resize only touches the tail. On the
CPU (and as the fallback elsewhere) the tensor's storage is resized in place; the CUDA path maps
and unmaps physical chunks of a reserved address range instead (no copy, stable addresses).
"""

from __future__ import annotations

import torch


def resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A view of `rows` rows over t's storage, resized; rows below min(rows, len(t)) keep their
    data, new rows are uninitialised. `t` and every older view of it are invalid afterwards."""
    if t.storage_offset() != 0 or not t.is_contiguous():
        raise ValueError("resize_rows needs a contiguous tensor that owns its storage from offset 0")
    row_shape = tuple(t.shape[1:])
    row_bytes = t.element_size()
    for d in row_shape:
        row_bytes *= d
    storage = t.untyped_storage()
    storage.resize_(rows * row_bytes)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (rows, *row_shape))
