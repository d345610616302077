"""The runner's staging arena (`ft.engine.buffers.StagingArena`): deferred loads reach the device at
the flush, in one copy, the page table's spread after it; a buffer grown past its region leaves
the arena and copies at once."""

from __future__ import annotations

import torch

from ft.engine.buffers import PageTableBuffer, StagedBuffer, StagingArena

CPU = torch.device("cpu")


def _arena():
    arena = StagingArena([4 * 8, 3 * 4, PageTableBuffer.arena_bytes(2, 3)], CPU)
    ids = StagedBuffer(4, torch.int64, CPU, arena=(arena, 0))
    lens = StagedBuffer(3, torch.int32, CPU, arena=(arena, 1))
    table = PageTableBuffer(2, 3, CPU, arena=(arena, 2))
    return arena, ids, lens, table


def test_deferred_loads_arrive_at_the_flush_in_one_copy():
    arena, ids, lens, table = _arena()
    a = ids.load([5, 6, 7], defer=True)
    b = lens.load([1, 2], defer=True)
    rows = table.load_rows([[9], [3, 4]], defer=True)
    assert a.tolist() == [0, 0, 0] and b.tolist() == [0, 0] and rows.tolist() == [[0, 0, 0], [0, 0, 0]]
    arena.flush()
    assert arena.flushes == 1
    assert a.tolist() == [5, 6, 7] and b.tolist() == [1, 2]
    assert rows[0, :1].tolist() == [9] and rows[1, :2].tolist() == [3, 4]
    arena.flush()  # nothing written since: no copy
    assert arena.flushes == 1
    # views of the arena's device block, at fixed addresses
    lo = arena.device_block.data_ptr()
    assert all(lo <= t.data_ptr() < lo + arena.device_block.numel() for t in (a, b))


def test_loads_without_defer_copy_at_once_and_regions_do_not_overlap():
    arena, ids, lens, table = _arena()
    assert ids.load([1, 2, 3, 4]).tolist() == [1, 2, 3, 4]
    assert lens.load([7, 8, 9]).tolist() == [7, 8, 9]
    assert table.load_rows([[1, 2, 3], [4, 5, 6]]).tolist() == [[1, 2, 3], [4, 5, 6]]
    assert ids.device_buffer.tolist() == [1, 2, 3, 4] and lens.device_buffer.tolist() == [7, 8, 9]
    assert arena.flushes == 0


def test_a_grown_buffer_leaves_the_arena():
    arena, ids, lens, table = _arena()
    out = ids.load([1, 2, 3, 4, 5, 6], defer=True)  # past its region of 4
    assert out.tolist() == [1, 2, 3, 4, 5, 6] and ids.capacity >= 6
    rows = table.load_rows([[1], [2], [3]], defer=True)  # 3 rows: past the region's 2
    assert rows[:, :1].tolist() == [[1], [2], [3]]
    arena.flush()
    assert arena.flushes == 0  # nothing of the arena was written
