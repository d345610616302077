"""The device memory probe on a real card: its reading is the driver's count (what
`torch.cuda.mem_get_info` says), an allocation of 1 GiB shows in a fresh reading and not in a cached
one, and an engine's probe sees the emulated card it was given."""

from __future__ import annotations

import pytest
import torch

from ft.memory.device_memory import DeviceMemoryProbe

pytestmark = pytest.mark.gpu

GIB = 2**30


def test_the_probe_follows_the_driver_count():
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    probe = DeviceMemoryProbe(dev, total, 0, interval_s=3600.0)
    first = probe.read()
    free, _ = torch.cuda.mem_get_info(dev)
    assert abs(first.used_bytes - (total - free)) < 64 * 2**20  # (another stream may allocate between the two)
    block = torch.empty(GIB, dtype=torch.uint8, device=dev)
    assert probe.read() == first  # cached within the interval
    fresh = probe.read(fresh=True)
    assert fresh.used_bytes - first.used_bytes >= GIB - 64 * 2**20
    assert fresh.allocator_peak_bytes >= GIB
    del block


def test_an_engine_probes_the_emulated_card():
    from ft.engine import LLM

    llm = LLM(model="demo", device="cuda", gpu_memory_limit=8 * GIB)
    d = llm.engine.device_memory.read(fresh=True)
    assert d.card_bytes == 8 * GIB and d.headroom_bytes == llm.engine.cache.budget.headroom_bytes > 0
    assert 0 < d.used_bytes and d.allocator_peak_bytes > 0


def test_the_budget_counts_the_allocators_cached_blocks_as_free(caplog):
    """Blocks torch's caching allocator keeps after a load's temporaries are freed count as used by the
    driver; the budget measures the free memory with them returned (the pools cannot use them)."""
    from ft.memory.budget import measure_budget

    dev = torch.device("cuda", torch.cuda.current_device())
    block = torch.empty(GIB, dtype=torch.uint8, device=dev)
    del block  # (cached by the allocator, not returned)
    held_before = torch.cuda.memory_reserved(dev)
    assert held_before >= GIB
    cached_free, _ = torch.cuda.mem_get_info(dev)
    with caplog.at_level("INFO", logger="ft.memory"):
        b = measure_budget(dev, 0, 1.0, None, 0)
    assert "returned before the free memory is measured" in caplog.text  # (the line names the bytes)
    assert torch.cuda.memory_reserved(dev) <= held_before - GIB
    assert b.free_bytes >= cached_free + GIB - 64 * 2**20
