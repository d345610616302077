"""Torch reference of `ft.kernels.slot_write.write_slots` (a host read of the slots' mask)."""

from __future__ import annotations

import torch


def write_slots_ref(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, page_size: int | None = None) -> None:
    """As `write_slots`: only rows with a slot >= 0 are written."""
    keep = (slots >= 0).nonzero().flatten()
    if not keep.numel():
        return
    s = slots[keep].long()
    value = rows[keep].to(device=pool.device, dtype=pool.dtype)
    if page_size is not None:
        pool[s // page_size, s % page_size] = value
    else:
        pool[s] = value
