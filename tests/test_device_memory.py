"""The card by the driver's count beside the planned budget (`ft.memory.device_memory`): the probe's
readings and their interval, the budget's headroom, and where the figures show (the startup banner,
`ft ctl cache`, `ft top`'s pools panel, `bench/serve.py`). On the CPU there is no driver count: a
fake CUDA device stands in (torch.cuda's two queries patched), which is what the probe reads there."""

from __future__ import annotations

import asyncio
import types

import pytest
import torch

from bench.serve import device_line, device_memory
from ft.ctl.format import format_cache
from ft.errors import ConfigError
from ft.memory.budget import CPU_DEFAULT_CARD, measure_budget
from ft.memory.device_memory import DeviceMemory, DeviceMemoryProbe
from ft.schemas import CacheState, DeviceState

GIB = 2**30


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's memory queries on a pretend 80 GiB device with `state["free"]` free; counts the calls."""
    state = {"free": 50 * GIB, "peak": 20 * GIB, "calls": 0}

    def mem_get_info(device=None):
        state["calls"] += 1
        return state["free"], 80 * GIB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: state["peak"])
    return state


def test_the_probe_reads_nothing_on_the_cpu():
    assert DeviceMemoryProbe(torch.device("cpu"), CPU_DEFAULT_CARD, 0).read() is None


def test_the_probe_reads_the_driver_count_once_an_interval(fake_cuda, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("ft.memory.device_memory.time.monotonic", lambda: clock[0])
    # an emulated 32 GiB card on the 80 GiB device: 30 GiB in use by the driver's count
    probe = DeviceMemoryProbe(torch.device("cuda", 0), 32 * GIB, 2 * GIB, interval_s=1.0)
    assert probe.read() == DeviceMemory(32 * GIB, 30 * GIB, 20 * GIB, 2 * GIB)
    assert probe.read().untouched_bytes == 2 * GIB
    fake_cuda["free"] = 40 * GIB  # 40 GiB in use: more than the emulated card took
    clock[0] += 0.5
    assert probe.read().used_bytes == 30 * GIB and fake_cuda["calls"] == 1  # the cached reading
    assert probe.read(fresh=True).used_bytes == 40 * GIB and fake_cuda["calls"] == 2
    assert probe.read().untouched_bytes == 0  # (never negative)
    fake_cuda["free"] = 49 * GIB
    clock[0] += 1.0
    assert probe.read().used_bytes == 31 * GIB and fake_cuda["calls"] == 3


def test_the_default_headroom_is_a_tenth_of_the_free_memory_at_most_the_cap():
    from ft.memory.budget import HEADROOM_CAP, headroom_for

    assert headroom_for(5 * GIB, None) == 5 * GIB - int(5 * GIB * 0.9)  # under the cap: a tenth
    assert headroom_for(27 * GIB, None) == HEADROOM_CAP == GIB  # a 32 GiB card's free memory: the cap
    assert headroom_for(27 * GIB, None, capped=False) == 27 * GIB - int(27 * GIB * 0.9)  # resident, TP: a tenth
    assert headroom_for(27 * GIB, 0.9) == 27 * GIB - int(27 * GIB * 0.9)  # --memory-ratio as given
    assert headroom_for(27 * GIB, 1.0) == 0
    cpu = measure_budget(torch.device("cpu"), 16 * 2**20, None, None, 0)  # the demo's card: a tenth, as before
    assert cpu.headroom_bytes == measure_budget(torch.device("cpu"), 16 * 2**20, 0.9, None, 0).headroom_bytes > 0
    with pytest.raises(ConfigError, match=r"--memory-ratio must be in \(0, 1\], got 1.5"):
        measure_budget(torch.device("cpu"), 0, 1.5, None, 0)


def test_the_budget_names_the_headroom_the_ratio_keeps():
    b = measure_budget(torch.device("cpu"), 16 * 2**20, 0.9, None, 4 * 2**20)
    free = CPU_DEFAULT_CARD - 16 * 2**20
    assert b.free_bytes == free and b.headroom_bytes == free - int(free * 0.9)
    assert b.budget_bytes + b.reserve_bytes + b.headroom_bytes == free
    assert measure_budget(torch.device("cpu"), 16 * 2**20, 1.0, None, 0).headroom_bytes == 0
    # a --cache-budget cap leaves more idle, but the headroom is still the ratio's
    assert measure_budget(torch.device("cpu"), 16 * 2**20, 0.9, None, 0, cap=2**20).headroom_bytes == b.headroom_bytes


class FakeProbe:
    """`DeviceMemoryProbe`'s interface with a fixed reading; records each read's `fresh`."""

    def __init__(self, reading: DeviceMemory) -> None:
        self.reading, self.fresh = reading, []

    def read(self, fresh: bool = False) -> DeviceMemory:
        self.fresh.append(fresh)
        return self.reading


def test_the_budget_measures_the_free_memory_with_the_allocators_cached_blocks_returned(fake_cuda, monkeypatch,
                                                                                        caplog):
    """A load's temporaries left in torch's cache count as used by the driver; the budget returns them first
    (the pools, mapped through the driver, could never have them) and says how much."""
    cache = {"held": 5 * GIB, "cached": 3 * GIB}  # 5 GiB held by the allocator, 3 of them unused blocks

    def empty_cache():
        fake_cuda["free"] += cache["cached"]
        cache["held"] -= cache["cached"]
        cache["cached"] = 0

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: cache["held"])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device=None: None)
    with caplog.at_level("INFO", logger="ft.memory"):
        b = measure_budget(torch.device("cuda", 0), 2 * GIB, None, 32 * GIB, GIB, capped_headroom=True)
    # the 80 GiB device had 50 GiB free, 53 with the blocks returned: 27 GiB in use, so a 32 GiB card has 5 free
    assert b.free_bytes == 5 * GIB and b.card_bytes == 32 * GIB
    assert b.headroom_bytes == 5 * GIB - int(5 * GIB * 0.9) and b.budget_bytes == 5 * GIB - b.headroom_bytes - GIB
    assert "budget: 3.0 GiB of blocks the caching allocator held since loading returned" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="ft.memory"):
        assert measure_budget(torch.device("cuda", 0), 2 * GIB, None, 32 * GIB, GIB).free_bytes == 5 * GIB
    assert "returned" not in caplog.text  # nothing cached: no line


DEVICE = DeviceState(card_bytes=32 * GIB, used_bytes=int(29.5 * GIB), allocator_peak_bytes=27 * GIB,
                     headroom_bytes=int(2.4 * GIB))


def test_ft_ctl_cache_shows_the_card_on_a_cuda_server():
    assert not any("device:" in line for line in format_cache(CacheState()).splitlines())  # CPU, older servers
    assert ("  device: 29.5 GiB of 32.0 GiB in use (driver's count; allocator peak 27.0 GiB), 2.5 GiB never taken; "
            "headroom 2.4 GiB kept back from the pools") in format_cache(CacheState(device=DEVICE)).splitlines()


def test_ft_top_pools_panel_shows_the_card():
    from textual.app import App

    from ft.tui.widgets.pools import PoolsPanel

    class Host(App):
        def compose(self):
            yield PoolsPanel()

    def text_of(panel) -> str:
        return "\n".join(t.plain for t in panel.render().renderables)

    async def scenario():
        app = Host()
        async with app.run_test(size=(160, 12)) as pilot:
            panel = app.query_one(PoolsPanel)
            panel.cache = CacheState(budget_bytes=20 * GIB)
            await pilot.pause()
            assert "untouched" not in text_of(panel)
            panel.cache = CacheState(budget_bytes=20 * GIB, device=DEVICE)
            await pilot.pause()
            assert "card 29.5 GiB/32.0 GiB used (driver), 2.5 GiB untouched, headroom 2.4 GiB" in text_of(panel)
            assert "host memory" not in text_of(panel)
            panel.cache = CacheState(budget_bytes=20 * GIB, host_memory={  # (what the server pins on the host)
                "parts": {"routed experts": 63 * GIB, "prefix states": GIB}, "available_bytes": 124 * GIB})
            await pilot.pause()
            assert "host memory 64.0 GiB of 124.0 GiB" in text_of(panel)

    asyncio.run(scenario())


def test_the_banner_names_the_card_after_the_warm_up():
    from ft.serve_cmd import _device_lines

    cpu = types.SimpleNamespace(device_memory=DeviceMemoryProbe(torch.device("cpu"), CPU_DEFAULT_CARD, 0))
    assert _device_lines(cpu) == []
    probe = FakeProbe(DeviceMemory(32 * GIB, 30 * GIB, 27 * GIB, int(2.4 * GIB)))
    assert _device_lines(types.SimpleNamespace(device_memory=probe)) == [
        "  device: 30.0 GiB of the 32.0 GiB card in use by the driver's count (the caching allocator's peak 27.0 "
        "GiB); 2.0 GiB never taken (/metrics ft_device_memory_*)"]
    assert probe.fresh == [True]  # read now, not a reading from before the warm-up


def test_bench_serve_reads_the_device_gauges():
    names = {"ft_device_memory_card_bytes": 32 * GIB, "ft_device_memory_used_bytes": 30 * GIB,
             "ft_device_memory_allocator_peak_bytes": 27 * GIB, "ft_device_memory_headroom_bytes": GIB}
    samples = {(name, None): float(v) for name, v in names.items()}
    samples[("ft_engine_steps_total", "decode")] = 5.0
    d = device_memory(samples, 31 * GIB)  # a probe during the level saw more in use than its end
    assert d == {"card_bytes": 32 * GIB, "used_bytes": 30 * GIB, "allocator_peak_bytes": 27 * GIB,
                 "headroom_bytes": GIB, "used_most_bytes": 31 * GIB}
    assert device_line(d) == ("device: 30.00 of 32.00 GiB in use at the end, 31.00 at most (allocator peak 27.00), "
                              "1.00 GiB never taken; headroom 1.00 GiB")
    assert device_memory(samples, None)["used_most_bytes"] == 30 * GIB  # no probe saw one: the end's
    assert device_memory(samples, 29 * GIB)["used_most_bytes"] == 30 * GIB  # the end's when larger
    assert device_memory({("ft_engine_steps_total", "decode"): 5.0}) is None and device_memory(None) is None


def test_bench_serve_finds_the_used_gauge_in_a_metrics_answer():
    from bench.serve import used_bytes_in

    text = ("# HELP ft_device_memory_used_bytes The device's memory in use\n"
            "# TYPE ft_device_memory_used_bytes gauge\n"
            'ft_device_memory_used_bytes{model_name="m"} 3.221225472e+10\n'
            'ft_device_memory_used_bytes_total{model_name="m"} 1.0\n')
    assert used_bytes_in(text) == 30 * GIB
    assert used_bytes_in('ft_requests_running{model_name="m"} 1.0\n') is None


@pytest.mark.parametrize("backend,capped", [("offload", True), ("resident", False)])
def test_an_engine_caps_the_default_headroom_only_with_offloaded_experts(backend, capped):
    from ft.engine import LLM
    from ft.memory.budget import HEADROOM_CAP

    llm = LLM(model="demo", device="cpu", gpu_memory_limit="32GiB", moe_backend=backend)
    b = llm.engine.cache.budget
    tenth = b.free_bytes - int(b.free_bytes * 0.9)
    assert b.headroom_bytes == (HEADROOM_CAP if capped else tenth) and tenth > HEADROOM_CAP
    assert b.budget_bytes == b.free_bytes - b.headroom_bytes - b.reserve_bytes
    given = LLM(model="demo", device="cpu", gpu_memory_limit="32GiB", moe_backend=backend, memory_ratio=0.9)
    assert given.engine.cache.budget.headroom_bytes == tenth  # --memory-ratio as given, either backend
