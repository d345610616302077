"""Per-row states written back to the slots of a step's rows, skipping rows without a slot.

A decode step's padding rows (a CUDA graph bucket's rows past the batch) and overlapped decode's rows
whose sequence ended carry slot -1. A torch index write (`pool[slots] = rows`) would wrap -1 to the
pool's last slot, which may belong to a live sequence; `write_slots` writes only rows with a slot >= 0,
in one launch and without a host read (a CUDA graph may hold it). `reference.py` is the contract (a
boolean mask: a host read of the slots), `kernel.py` the Triton kernel; the dispatcher picks as the
other kernel packages do. Users: Qwen3.8-Flash-Next's n-gram context and PLE conv history (mamba
slots) and QSA's raw indexer keys (KV token slots)."""

from __future__ import annotations

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.slot_write.reference import write_slots_ref

__all__ = ["write_slots", "write_slots_ref"]


def write_slots(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, page_size: int | None = None) -> None:
    """pool[slot] = rows[i] (converted to pool's dtype) for every i with slots[i] >= 0; rows with a
    negative slot write nothing. slots [B] integer on pool's device; rows [B, *row]. Without page_size
    pool is [S, *row]; with one, pool is [P, page_size, *row] and slot s is row
    (s // page_size, s % page_size) (a token slot of a paged pool). `*row` must be contiguous in pool
    (any strides above it); two rows with the same slot >= 0 are the caller's error."""
    if uses_triton(pool.device) and pool.device == rows.device:
        from ft.kernels.slot_write.kernel import write_slots_triton  # NOTE: imports triton only when used

        write_slots_triton(pool, slots, rows, page_size)
        return
    write_slots_ref(pool, slots, rows, page_size)
