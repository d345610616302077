"""`ft top`'s pure logic: budget-bar arithmetic, range checks, ring buffers, lenient parsing, and
that its pool cells read exactly as `ft ctl cache` prints them. No UI here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ft.ctl.format import format_cache
from ft.schemas import CacheState, Event, LiveRates
from ft.tui.source import lenient, rates_between
from ft.tui.state import (RateHistory, backoff_delays, budget_segments, check_targets, format_uptime, parse_target,
                          pool_cells, range_track)


def state(**over) -> CacheState:
    data = {
        "state": "serving", "model": "ft-demo", "budget_bytes": 1000, "allocated_bytes": 900,
        "pools": {
            "moe": {"size": 100, "bytes": 500, "min": 4, "max": 120, "total_experts": 512, "hit_rate": 0.5},
            "kv": {"size": 512, "bytes": 300, "min": 64, "max": 853, "page_size": 64, "pages": 8, "used": 2},
            "mamba": {"size": 10, "bytes": 100, "min": 1, "max": 20, "used": 3},
        },
    }
    data.update(over)
    return CacheState.model_validate(data)


@pytest.mark.parametrize("width", [1, 3, 4, 10, 37, 80, 157])
def test_budget_segments_sum_to_width(width):
    segs = budget_segments(state(), width)
    assert [s.kind for s in segs] == ["moe", "kv", "mamba", "free"]
    assert sum(s.cells for s in segs) == width
    if width >= 4:
        assert all(s.cells >= 1 for s in segs if s.kind != "free")


def test_budget_segments_proportional():
    cells = {s.kind: s.cells for s in budget_segments(state(), 100)}
    assert cells == {"moe": 50, "kv": 30, "mamba": 10, "free": 10}


def test_tiny_pool_keeps_a_cell():
    s = state(budget_bytes=100000, allocated_bytes=1000)
    cells = {x.kind: x.cells for x in budget_segments(s, 20)}
    assert cells["mamba"] >= 1 and sum(cells.values()) == 20


def test_budget_segments_empty_state():
    assert sum(s.cells for s in budget_segments(CacheState(), 10)) == 10
    assert budget_segments(CacheState(), 0) == []


def test_range_track():
    tr = range_track(state(), "moe", 100)  # 5 bytes a slot: min 20 B, cur 500 B, max 600 B of 1000
    assert (tr.lo, tr.cur, tr.hi) == (2, 50, 60)
    tr = range_track(state(), "kv", 10)
    assert 0 <= tr.lo <= tr.cur <= tr.hi <= 10


def test_check_targets_alone_and_joint():
    s = state()
    assert check_targets(s, {"kv": 800}) == []
    assert check_targets(s, {"kv": 900}) == ["kv 900 is outside 64..853"]
    assert check_targets(s, {"mamba": 0}) == ["mamba 0 is outside 1..20"]
    assert check_targets(s, {"moe": 130}) == ["moe 130 is outside 4..120"]
    # moe gives up 40 slots (200 B), so kv may go past its alone-maximum
    assert check_targets(s, {"moe": 60, "kv": 1000}) == []
    assert check_targets(s, {"moe": 60, "kv": 1100}) == ["moe 60 is outside 4..51"]  # 1044 B > 1000 B
    assert check_targets(s, {"moe": 100, "kv": 512}) == []  # unchanged pools are not checked
    assert check_targets(s, {"kv": -1}) == ["kv must be 0 or more, got -1"]


def test_parse_target():
    assert parse_target("") is None and parse_target("  ") is None
    assert parse_target("65_536") == 65536 and parse_target("65,536") == 65536
    with pytest.raises(ValueError):
        parse_target("12x")


def test_pool_cells_match_ft_ctl_cache():
    s = state()
    text = format_cache(s)
    for name, cells in pool_cells(s).items():
        line = next(l for l in text.splitlines() if l.strip().startswith(name + " "))
        for cell in cells:
            assert cell in line, (cell, line)


def test_rate_history_ring():
    h = RateHistory(3)
    for i in range(5):
        h.push(LiveRates(decode_tokens_per_s=i, expert_hit_rate=2.0, kv_usage=-1))
    assert len(h) == 3
    assert h.series() == {"decode": [2.0, 3.0, 4.0], "hit_rate": [1.0] * 3, "kv_usage": [0.0] * 3}
    with pytest.raises(ValueError):
        RateHistory(0)


def test_backoff_and_uptime():
    g = backoff_delays()
    assert [next(g) for _ in range(7)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert [format_uptime(s) for s in (5, 303, 7620, 273600)] == ["5 s", "5m03s", "2h07m", "3d04h"]


def test_lenient_parse_of_old_and_partial_payloads():
    assert lenient(Event, None) == Event()
    ev = lenient(Event, {"kind": "tick", "cache": {"state": "stopping", "pools": {"kv": {"size": "lots", "used": 3}}},
                         "rates": {"kv_usage": 0.5}, "new_field": 1})
    assert ev.cache.state == "starting" and ev.cache.pools.kv.size == 0 and ev.cache.pools.kv.used == 3
    assert ev.rates.kv_usage == 0.5
    assert lenient(Event, {"kind": "weird"}).kind == "tick"


def test_rates_between_polls():
    a, b = state(), state()
    b.pools.moe.hits, b.pools.moe.misses = 30, 10
    r = rates_between(a, b)
    assert r.expert_hit_rate == 0.75 and r.kv_usage == 2 / 8 and r.decode_tokens_per_s == 0


def test_import_hygiene_no_torch():
    code = ("import sys, ft.tui, ft.tui.app, ft.tui.cli, ft.tui.source, ft.tui.state; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'ft.engine', 'ft.server'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
