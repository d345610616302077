"""Rows of a table kept in host memory, gathered onto the device by ids that live there:
`reference.py` (torch: the ids read back to the host, the rows copied over) and the Triton kernels in
`kernel.py` (the device reads the pinned table in place: no host read of the ids, one launch, a CUDA
graph may hold it), and these dispatchers. Two users: Qwen3.8-Flash-Next's n-gram table (~95 GiB;
`gather_rows`: each token reads 16 rows of 160 values, 5 KiB in bf16), and the streamed prefill's
expert slabs (`copy_rows`: ~1.8 MB rows of a layer's host store into a staging page, one launch per
page and tensor where copies would take one call per run of consecutive experts)."""

from __future__ import annotations

import torch

from ft.kernels.backend import uses_triton
from ft.kernels.host_gather.reference import copy_rows_ref, gather_rows_ref

__all__ = ["copy_rows", "copy_rows_ref", "gather_rows", "gather_rows_ref"]


def gather_rows(table: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """table [R, W] (host memory; pinned where the device is a GPU), rows [T, H] int64 on the compute
    device -> [T, H * W] in `dtype` on rows' device: row rows[t, h] of the table at columns h*W..(h+1)*W.
    The Triton kernel where it runs (its table must be pinned on CUDA), else `gather_rows_ref`."""
    if uses_triton(rows.device) and (rows.device.type != "cuda" or table.is_pinned()):
        from ft.kernels.host_gather.kernel import gather_rows_triton  # NOTE: imports triton only when used

        return gather_rows_triton(table, rows, dtype)
    return gather_rows_ref(table, rows, dtype)


def copy_rows(out: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, options=None) -> None:
    """out[i] = table[rows[i]] bit for bit for i < len(rows): out [N, ...] on the compute device, table
    [R, ...] with the same row shape and dtype (host memory, pinned where the device is a GPU), rows
    [n <= N] int32/int64 on out's device. The Triton kernel where it runs (on the current stream;
    `options`: a `kernel.CopyRowsOptions`, default `kernel.COPY_ROWS`), else `copy_rows_ref`."""
    if uses_triton(out.device) and (out.device.type != "cuda" or table.is_pinned() or table.device == out.device):
        from ft.kernels.host_gather.kernel import COPY_ROWS, copy_rows_triton  # NOTE: imports triton only when used

        copy_rows_triton(out, table, rows, options or COPY_ROWS)
        return
    copy_rows_ref(out, table, rows)
