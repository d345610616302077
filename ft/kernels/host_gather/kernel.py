"""The host-table gathers in Triton: the device reads a pinned table in place (a pinned table is
device-addressable), so the ids never come back to the host and one launch moves every row.

* `gather_rows_triton`: one program per (token, head) pair reads its row and writes it, converted,
  into its columns (the n-gram table's lookups).
* `copy_rows_triton`: whole rows moved as raw words into an existing buffer by a bounded grid of
  programs (the streamed prefill's expert slabs into a staging page, on a copy stream beside the
  compute: `CopyRowsOptions.programs` caps the SMs it takes and sets the bytes in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class CopyRowsOptions:
    """How `copy_rows_triton` spreads its words: `programs` programs (at most: fewer when the rows
    have fewer tiles) each move tiles of `block_words` words (int32 where a row's bytes allow, else
    bytes) with `num_warps` warps, a tile in flight per program. Reads over PCIe wait ~2 us, so the
    bus wants ~100 KB in flight: 32 programs x 16 KB is five times that. Measured (H200, 1.77 MB rows,
    bench/stream_copy.py): 8 to 132 programs, tiles of 2K-8K words, all read 50.0-50.5 GB/s."""

    programs: int = 32
    block_words: int = 4096
    num_warps: int = 4


COPY_ROWS = CopyRowsOptions()


@triton.jit(do_not_specialize=["n"])  # a page's id count varies (1, multiples of 16): one compile serves all
def _copy_rows_kernel(p_table, p_rows, p_out, n, words, stride_table, stride_out, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    blocks = tl.cdiv(words, BLOCK)
    o = tl.arange(0, BLOCK)
    for tile in range(pid, n * blocks, programs):
        i = tile // blocks
        c = (tile - i * blocks).to(tl.int64) * BLOCK + o
        row = tl.load(p_rows + i).to(tl.int64)
        m = c < words
        v = tl.load(p_table + row * stride_table + c, mask=m)
        tl.store(p_out + i.to(tl.int64) * stride_out + c, v, mask=m)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """t [R, ...] contiguous per row -> [R, words]: its bytes as int32 where each row's bytes and the
    first row's address are 4-aligned, else as bytes (a view, nothing copied)."""
    flat = t.reshape(t.shape[0], -1)
    if flat.shape[1] and flat.stride(1) != 1:
        raise ValueError(f"copy_rows: rows must be contiguous, got strides {t.stride()}")
    b = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    if b.shape[1] % 4 == 0 and b.data_ptr() % 4 == 0 and b.stride(0) % 4 == 0:
        return b.view(torch.int32)
    return b


def copy_rows_triton(out: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                     options: CopyRowsOptions = COPY_ROWS) -> None:
    """As `copy_rows_ref`, on the current stream: out [N, ...] on the device, table [R, ...] pinned
    host memory (or the device's), rows [n <= N] int32/int64 on the device. Raises ValueError for
    mismatched rows, dtypes or ids that are not 1-D; ids outside the table are the caller's to
    prevent."""
    if out.shape[1:] != table.shape[1:] or out.dtype != table.dtype:
        raise ValueError(f"copy_rows: rows differ, out {tuple(out.shape)} {out.dtype} against table "
                         f"{tuple(table.shape)} {table.dtype}")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"copy_rows: ids must be [n] int32 or int64, got {tuple(rows.shape)} {rows.dtype}")
    n = rows.numel()
    if n > out.shape[0]:
        raise ValueError(f"copy_rows: {n} ids for {out.shape[0]} rows")
    if not n or not out[0].numel():
        return
    dst, src = _as_words(out), _as_words(table)
    if dst.dtype != src.dtype:  # one side's address is not 4-aligned: move bytes on both
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    words = dst.shape[1]
    block = min(options.block_words, triton.next_power_of_2(words))
    tiles = n * triton.cdiv(words, block)
    _copy_rows_kernel[(min(options.programs, tiles),)](src, rows, dst, n, words, src.stride(0), dst.stride(0),
                                                        BLOCK=block, num_warps=options.num_warps)
