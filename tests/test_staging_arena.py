"""The runner's staging arena (`ft.engine.worker.buffers.StagingArena`): deferred loads reach the device at
the flush, in one copy, the page table's spread after it; a buffer grown past its region leaves
the arena and copies at once."""

from __future__ import annotations

import torch

from ft.engine.worker.buffers import PageTableBuffer, StagedBuffer, StagingArena

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


def _decode_table(rows=3, cols=8):
    arena = StagingArena([PageTableBuffer.arena_bytes(rows, cols)], CPU)
    return arena, PageTableBuffer(rows, cols, CPU, arena=(arena, 0))


def test_decode_rows_send_only_new_pages():
    """A row that holds the same page list (the same object, appended to in place) gets only its new
    pages; an unchanged batch writes nothing; a replaced list, an in-place edit, a prefill's load
    in between or a realloc rewrite the rows."""
    arena, table = _decode_table()
    a, b = [1, 2], [5]
    rows = table.load_rows([a, b], defer=True)
    arena.flush()
    assert arena.flushes == 1 and rows[0, :2].tolist() == [1, 2] and rows[1, :1].tolist() == [5]
    table.load_rows([a, b], defer=True)
    arena.flush()
    assert arena.flushes == 1  # nothing changed: no copy, no scatter
    a.append(3)  # decode: a new page, in place
    table.load_rows([a, b], defer=True)
    assert table._host_np[:2].tolist() == [2, 3]  # one (flat index, page) pair staged: row 0, column 2
    arena.flush()
    assert arena.flushes == 2 and rows[0, :3].tolist() == [1, 2, 3]
    a = [7, 8, 9]  # a rebuild moved its pages: a new list
    table.load_rows([a, b], defer=True)
    arena.flush()
    assert rows[0, :3].tolist() == [7, 8, 9] and rows[1, :1].tolist() == [5]
    a[-1] = 4  # an in-place edit of the last page: caught by the row's check
    table.load_rows([a, b], defer=True)
    arena.flush()
    assert rows[0, :3].tolist() == [7, 8, 4]
    table.load([[6, 6, 6], [6]])  # a prefill in between writes rows 0 and 1
    table.load_rows([a, b], defer=True)
    arena.flush()
    assert rows[0, :3].tolist() == [7, 8, 4] and rows[1, :1].tolist() == [5]


def test_decode_rows_match_a_full_rewrite_under_random_steps():
    """Random decode batches (rows moving between sequences, pages appended, lists replaced,
    prefills in between): after every flush each row holds its sequence's pages."""
    import random

    rng = random.Random(7)
    arena, table = _decode_table(rows=4, cols=16)
    seqs = [[rng.randrange(100)] for _ in range(6)]
    for step in range(300):
        op = rng.random()
        if op < 0.2:
            k = rng.randrange(len(seqs))
            seqs[k] = [rng.randrange(100) for _ in range(rng.randrange(1, 6))]  # replaced
        elif op < 0.25:
            table.load([[rng.randrange(100)] * 3 for _ in range(rng.randrange(1, 4))])  # a prefill
        for s in seqs:
            if len(s) < 16 and rng.random() < 0.3:
                s.append(rng.randrange(100))
        batch = rng.sample(seqs, rng.randrange(1, 5))
        rows = table.load_rows(batch, defer=True)
        arena.flush()
        for i, s in enumerate(batch):
            assert rows[i, : len(s)].tolist() == s, step
