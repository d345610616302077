"""The host-table gather in Triton: one program per (token, head) pair reads its table row from host
memory in place (a pinned table is device-addressable) and writes it, converted, into its columns."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows_kernel(p_table, p_rows, p_out, W, stride_table, stride_out, H, BLOCK_W: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # pair t * H + h
    t, h = i // H, i % H
    row = tl.load(p_rows + i)
    o = tl.arange(0, BLOCK_W)
    m = o < W
    v = tl.load(p_table + row * stride_table + o, mask=m, other=0.0)
    tl.store(p_out + t * stride_out + h * W + o, v.to(p_out.dtype.element_ty), mask=m)


def gather_rows_triton(table: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As `gather_rows_ref`. Raises ValueError for a table that is not 2-D with unit column stride
    or rows that are not [T, H] int64; ids outside the table are the caller's to prevent (the model
    hashes into it by construction)."""
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"gather_rows: table must be [R, W] with contiguous rows, got {tuple(table.shape)} "
                         f"strides {table.stride()}")
    if rows.dim() != 2 or rows.dtype != torch.int64:
        raise ValueError(f"gather_rows: rows must be [T, H] int64, got {tuple(rows.shape)} {rows.dtype}")
    t, h = rows.shape
    w = table.shape[1]
    out = torch.empty(t, h * w, dtype=dtype, device=rows.device)
    if t * h:
        _gather_rows_kernel[(t * h,)](table, rows.contiguous(), out, w, table.stride(0), out.stride(0), h,
                                      BLOCK_W=triton.next_power_of_2(w), num_warps=1 if w <= 256 else 4)
    return out
