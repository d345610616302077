"""`write_slots` in Triton: program (row, block of its elements) loads its slot and stores its block
there, masked off where the slot is negative (no branch on the host, one launch for the batch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ft.kernels.pdl import pdl_args, pdl_release, pdl_wait

BLOCK = 1024
"""Elements a program moves (a row of the n-gram context is 2, a PLE history 3 x 10,240, an indexer key
128: small rows take one program, long ones a few)."""


@triton.jit
def _write_slots_kernel(p_pool, p_slots, p_rows, W, PAGE, stride_page, stride_slot, stride_rows,
                        BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # (`ft.kernels.pdl`: every program, before any load or store)
    pdl_release(PDL)
    i = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(p_slots + i).to(tl.int64) + tl.zeros_like(o)  # (a block: the mask is elementwise)
    m = (o < W) & (slot >= 0)
    slot = tl.where(m, slot, 0)
    v = tl.load(p_rows + i * stride_rows + o, mask=m, other=0)
    tl.store(p_pool + (slot // PAGE) * stride_page + (slot % PAGE) * stride_slot + o,
             v.to(p_pool.dtype.element_ty), mask=m)


def write_slots_triton(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
                       page_size: int | None = None) -> None:
    """As `ft.kernels.slot_write.write_slots`. Raises ValueError where pool's row is not contiguous or
    rows do not match it."""
    lead = 1 if page_size is None else 2
    if page_size is not None and (pool.dim() < 2 or pool.shape[1] != page_size):
        raise ValueError(f"write_slots: a paged pool must be [P, {page_size}, ...], got {tuple(pool.shape)}")
    row_shape = tuple(pool.shape[lead:])
    b = slots.numel()
    if tuple(rows.shape) != (b, *row_shape):
        raise ValueError(f"write_slots: rows {tuple(rows.shape)} for {b} slots of rows {row_shape}")
    w = 1
    for n in row_shape:
        w *= n
    if w and not pool[(0,) * lead].is_contiguous():
        raise ValueError(f"write_slots: the pool's rows must be contiguous (strides {pool.stride()})")
    if not b or not w:
        return
    rows = rows.reshape(b, w)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    stride_page = pool.stride(0)
    stride_slot = 0 if page_size is None else pool.stride(1)
    block = min(BLOCK, triton.next_power_of_2(w))
    _write_slots_kernel[(b, triton.cdiv(w, block))](
        pool, slots, rows, w, page_size or 1, stride_page, stride_slot, rows.stride(0), BLOCK=block,
        num_warps=1 if block <= 256 else 4, **pdl_args(pool.device))
