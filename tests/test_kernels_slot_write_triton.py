"""Writes to the slots of a step's rows (`ft.kernels.slot_write`): the Triton kernel against the torch
reference under the interpreter — a plain pool ([S, *row], int64 and fp32), a paged pool cut from a
wider tensor (QSA's per-layer indexer keys: [P, page, Di] with a layer stride), a row wider than one
program's block, a dtype conversion; rows with slot -1 write nothing (the pool's last slot, where a torch
index write would wrap them, is unchanged)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (by the kernels module below)

import pytest
import torch

pytest.importorskip("triton")

from ft.kernels.slot_write import write_slots_ref
from ft.kernels.slot_write import kernel as details


@pytest.mark.parametrize(("row", "dtype", "src_dtype"), [((2,), torch.int64, torch.int64),
                                                         ((3, 40), torch.float32, torch.float32),
                                                         ((1500,), torch.float32, torch.float16)],
                         ids=["ngram-context", "ple-history", "wide-converted"])
def test_a_plain_pool_equals_the_reference(row, dtype, src_dtype):
    g = torch.Generator().manual_seed(len(row))
    slots = torch.tensor([2, -1, 0, -1, 5])
    pool = (torch.randn(6, *row, generator=g) * 100).to(dtype)
    rows = (torch.randn(5, *row, generator=g) * 100).to(src_dtype)
    want, got = pool.clone(), pool.clone()
    write_slots_ref(want, slots, rows)
    details.write_slots_triton(got, slots, rows)
    assert torch.equal(got, want)
    assert not torch.equal(want[5], pool[5])  # slot 5 was written (a live row) ...
    assert torch.equal(want[[1, 3, 4]], pool[[1, 3, 4]])  # ... slots no row names are untouched
    assert torch.equal(want[2], rows[0].to(dtype)) and torch.equal(want[0], rows[2].to(dtype))


def test_padding_rows_never_wrap_to_the_last_slot():
    pool = torch.zeros(4, 8)
    rows = torch.ones(3, 8)
    slots = torch.tensor([0, -1, -1])
    details.write_slots_triton(pool, slots, rows)
    assert pool[0].eq(1).all() and pool[1:].eq(0).all()  # pool[-1] (slot 3) unchanged
    ref = torch.zeros(4, 8)
    write_slots_ref(ref, slots, rows)
    assert torch.equal(pool, ref)


def test_a_paged_pool_cut_from_a_wider_tensor_equals_the_reference():
    """[P, L, page, Di] cut at layer 1 -> [P, page, Di] (strides skip the other layers): slot s is
    (s // page, s % page)."""
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(5, 3, 4, 16, generator=g)
    slots = torch.tensor([19, -1, 6, 0, -1])  # the last page's last token among them
    rows = torch.randn(5, 16, generator=g)
    want, got = whole.clone(), whole.clone()
    write_slots_ref(want[:, 1], slots, rows, page_size=4)
    details.write_slots_triton(got[:, 1], slots, rows, page_size=4)
    assert torch.equal(got, want)
    assert torch.equal(want[4, 1, 3], rows[0]) and torch.equal(want[1, 1, 2], rows[2])
    assert torch.equal(want[:, [0, 2]], whole[:, [0, 2]])  # the other layers untouched


def test_it_checks_its_inputs():
    pool = torch.zeros(4, 8)
    details.write_slots_triton(pool, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8))  # no rows: nothing
    with pytest.raises(ValueError, match="rows"):
        details.write_slots_triton(pool, torch.tensor([0]), torch.zeros(1, 7))
    with pytest.raises(ValueError, match="contiguous"):
        details.write_slots_triton(torch.zeros(8, 4).t(), torch.tensor([0]), torch.zeros(1, 8))
    with pytest.raises(ValueError, match="paged"):
        details.write_slots_triton(pool, torch.tensor([0]), torch.zeros(1, 8), page_size=16)
