"""Torch references of the host-table gathers (`ft.kernels.host_gather`)."""

from __future__ import annotations

import torch


def gather_rows_ref(table: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table [R, W], rows [T, H] int64 -> [T, H * W] in `dtype` on rows' device (the ids go to the
    table's device, the rows come back: a host read when they differ)."""
    t, h = rows.shape
    out = table[rows.to(table.device)].reshape(t, h * table.shape[1])
    return out.to(device=rows.device, dtype=dtype)


def copy_rows_ref(out: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> None:
    """out[i] = table[rows[i]] for i < len(rows), bit for bit: out [N >= n, ...] and table [R, ...]
    with the same row shape and dtype, rows [n] integer ids (read on the table's device: a host read
    when they differ)."""
    n = rows.numel()
    if n:
        out[:n].copy_(table[rows.to(table.device).long()])
