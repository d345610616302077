"""The host-table gather (`ft.kernels.host_gather`): the Triton kernel against the torch reference under
the interpreter — widths that are and are not powers of two (160: the n-gram table's), repeated and
edge rows, fp32 and fp16 tables converted to another dtype, an empty batch; the output NaN-free and
exactly the table's values (a gather rounds nothing but the final conversion)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.host_gather import gather_rows_ref
from ft.kernels.host_gather import kernel as details

CASES = [(97, 160, 5, 16), (40, 32, 3, 2), (9, 7, 1, 1)]  # (table rows, width, tokens, heads)


@pytest.mark.parametrize(("table_dtype", "dtype"), [(torch.float32, torch.float32), (torch.float32, torch.float16),
                                                    (torch.float16, torch.float32)], ids=["fp32", "fp32-fp16", "fp16-fp32"])
@pytest.mark.parametrize(("r", "w", "t", "h"), CASES, ids=[f"R{r}-W{w}-T{t}-H{h}" for r, w, t, h in CASES])
def test_gather_rows_equals_the_reference(r, w, t, h, table_dtype, dtype):
    g = torch.Generator().manual_seed(r + w)
    table = torch.randn(r, w, generator=g).to(table_dtype)
    rows = torch.randint(0, r, (t, h), generator=g)
    rows[0, 0], rows[-1, -1] = 0, r - 1
    got = details.gather_rows_triton(table, rows, dtype)
    want = gather_rows_ref(table, rows, dtype)
    assert got.shape == (t, h * w) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(want.reshape(t, h, w), table[rows].to(dtype))  # the reference against its definition


def test_gather_rows_checks_its_inputs():
    table = torch.zeros(4, 8)
    assert details.gather_rows_triton(table, torch.zeros(0, 3, dtype=torch.int64), torch.float32).shape == (0, 24)
    with pytest.raises(ValueError, match="int64"):
        details.gather_rows_triton(table, torch.zeros(2, 3, dtype=torch.int32), torch.float32)
    with pytest.raises(ValueError, match="contiguous rows"):
        details.gather_rows_triton(table.t(), torch.zeros(2, 3, dtype=torch.int64), torch.float32)


ROW_SHAPES = [((3, 40), torch.uint8), ((5, 6), torch.float32), ((2, 3), torch.float16), ((7,), torch.uint8)]


@pytest.mark.parametrize(("shape", "dtype"), ROW_SHAPES, ids=[f"{'x'.join(map(str, s))}-{d}" for s, d in ROW_SHAPES])
@pytest.mark.parametrize("options", [details.COPY_ROWS, details.CopyRowsOptions(programs=3, block_words=8, num_warps=1)],
                         ids=["default", "tiles"])
def test_copy_rows_moves_whole_rows_bit_for_bit(shape, dtype, options):
    """Rows of 120, 30, 6 (2-byte words: moved as bytes) and 7 bytes, over default tiles and over 3
    programs of 8-word tiles (each program loops over many tiles); ids repeated and unsorted, the
    rows after the ids' count untouched."""
    g = torch.Generator().manual_seed(len(shape))
    table = (torch.randint(0, 255, (11, *shape), generator=g).to(dtype) if dtype == torch.uint8
             else torch.randn(11, *shape, generator=g).to(dtype))
    rows = torch.tensor([10, 0, 4, 4, 7], dtype=torch.int32)
    out = torch.full((6, *shape), 3, dtype=dtype)
    want = out.clone()
    from ft.kernels.host_gather import copy_rows_ref

    copy_rows_ref(want, table, rows)
    details.copy_rows_triton(out, table, rows, options)
    assert torch.equal(out.view(torch.uint8) if dtype != torch.uint8 else out, want.view(torch.uint8) if dtype != torch.uint8 else want)
    assert torch.equal(want[:5], table[rows.long()]) and torch.equal(want[5], torch.full(shape, 3, dtype=dtype))


def test_copy_rows_checks_its_inputs():
    table = torch.zeros(4, 8)
    details.copy_rows_triton(torch.zeros(2, 8), table, torch.zeros(0, dtype=torch.int64))  # no ids: nothing
    with pytest.raises(ValueError, match="rows differ"):
        details.copy_rows_triton(torch.zeros(2, 4), table, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="int32 or int64"):
        details.copy_rows_triton(torch.zeros(2, 8), table, torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="3 ids for 2 rows"):
        details.copy_rows_triton(torch.zeros(2, 8), table, torch.zeros(3, dtype=torch.int64))
