"""Rows of a table kept in host memory, gathered onto the device by the ids a step computes there:
`reference.py` (torch: the ids read back to the host, the rows copied over) and the Triton kernel in
`kernel.py` (the device reads the pinned table in place: no host read of the ids, one launch, a CUDA
graph may hold it), and this dispatcher. Qwen3.8-Flash-Next's n-gram table (~95 GiB) is the user:
each token reads 16 rows of 160 values (5 KiB in bf16)."""

from __future__ import annotations

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.host_gather.reference import gather_rows_ref

__all__ = ["gather_rows", "gather_rows_ref"]


def gather_rows(table: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table [R, W] (host memory; pinned where the device is a GPU), rows [T, H] int64 on the compute
    device -> [T, H * W] in `dtype` on rows' device: row rows[t, h] of the table at columns h*W..(h+1)*W.
    The Triton kernel where it runs (its table must be pinned on CUDA), else `gather_rows_ref`."""
    if uses_triton(rows.device) and (rows.device.type != "cuda" or table.is_pinned()):
        from ft.kernels.host_gather.kernel import gather_rows_triton  # NOTE: imports triton only when used

        return gather_rows_triton(table, rows, dtype)
    return gather_rows_ref(table, rows, dtype)
