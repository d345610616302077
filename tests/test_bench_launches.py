"""`bench/launches.py`'s counter (a decode step's device launches counted on the CPU): computing torch
operators and interpreted Triton launches count, views and metadata do not, host reads count as syncs,
nothing counts while disarmed, and the interpreter's launch is put back after the block."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

pytest.importorskip("triton")

from bench.launches import LaunchCounter


def test_it_counts_what_would_launch_on_a_device():
    import triton.runtime.interpreter as interp
    from ft.kernels.slot_write import kernel as slot_write

    run = interp.InterpretedFunction.run
    here = os.path.dirname(os.path.abspath(__file__))
    counter = LaunchCounter(here)
    x = torch.arange(12.0)
    pool, slots, rows = torch.zeros(4, 2), torch.tensor([1, -1]), torch.ones(2, 2)
    with counter.counting():
        counter.armed = True
        y = x + 1  # a kernel
        y.view(3, 4).t()  # views: none
        torch.empty(5)  # an allocation: none
        total = y.sum()  # a kernel
        float(total)  # a host read: a sync
        slot_write.write_slots_triton(pool, slots, rows)  # one launch
        counter.armed = False
        x * 2  # disarmed: not counted
    names = sorted(name for (_, name) in counter.launches.elements())
    assert names == ["aten.add", "aten.sum", "triton._write_slots_kernel"]
    assert all(site.startswith("test_bench_launches.py:test_it_counts") for site, _ in counter.launches)
    assert [name for _, name in counter.syncs] == ["_local_scalar_dense"]
    assert interp.InterpretedFunction.run is run
