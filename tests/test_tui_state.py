"""`ft top`'s pure logic: budget-bar arithmetic, range checks, ring buffers, lenient parsing, the
figures' age and the order of answers, rung labels, plot scales and rows, and
that its pool cells read exactly as `ft ctl cache` prints them. No UI here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ft.ctl.format import format_cache
from ft.schemas import CacheState, Event, LadderState, LiveRates, RequestList
from ft.tui.source import lenient, rates_between
from ft.tui.state import (RateHistory, backoff_delays, bucket_max, budget_segments, check_targets, format_age,
                          format_scale, format_uptime, is_newer, is_stale, nice_ceiling, parse_target, plot_rows,
                          pool_cells, range_track, rung_label)


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
        h.push(LiveRates(decode_tokens_per_s=i, expert_hit_rate=2.0, kv_usage=-1, engine_busy=i / 3))
    assert len(h) == 3
    assert h.series() == {"decode": [2.0, 3.0, 4.0], "hit_rate": [1.0] * 3, "kv_usage": [0.0] * 3,
                          "busy": [2 / 3, 1.0, 1.0]}  # (a share over 1, from instants a little apart: 1)
    assert h.slow_steps() == 0
    for i in range(3):
        h.push(LiveRates(slow_steps=2 if i == 0 else 0))
    assert h.slow_steps() == 2
    h.push(LiveRates())
    assert h.slow_steps() == 0  # out of the window
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
    assert r.expert_hit_rate == 0.75 and r.kv_usage == 2 / 8 and r.decode_tokens_per_s == 0 and r.engine_busy == 0


def test_import_hygiene_no_torch():
    code = ("import sys, ft.tui, ft.tui.app, ft.tui.cli, ft.tui.source, ft.tui.state; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'ft.engine', 'ft.server'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_age_and_staleness():
    assert [format_age(s) for s in (0, 0.44, 9.95, 12, 303)] == ["0.0 s", "0.4 s", "9.9 s", "12 s", "5m03s"]
    assert not is_stale(2.9, 1.0) and is_stale(3.1, 1.0)
    assert not is_stale(0.9, 0.1) and is_stale(1.1, 0.1)  # never under a second
    assert not is_stale(14, 5.0) and is_stale(16, 5.0)


def test_newer_answers_only():
    shown = state(uptime_s=100.0, started_at=5.0)
    assert is_newer(shown, None)
    assert is_newer(state(uptime_s=100.5, started_at=5.0), shown)
    assert is_newer(state(uptime_s=100.0, started_at=5.0), shown)  # the same moment: harmless
    assert not is_newer(state(uptime_s=99.9, started_at=5.0), shown)  # out of order
    assert is_newer(state(uptime_s=1.0, started_at=900.0), shown)  # a restart
    assert is_newer(CacheState(state="starting"), shown)  # not serving yet: no stamp
    assert not is_newer(RequestList(uptime_s=99.0, started_at=5.0), RequestList(uptime_s=99.5, started_at=5.0))


def test_rung_label_counts_from_one():
    lad = LadderState(enabled=True, rungs=[512, 768, 1024], current=1)
    assert [rung_label(lad, kv) for kv in (512, 768, 1024, 600, 256, 2048)] == [
        "rung 1/3", "rung 2/3", "rung 3/3", "between rungs 1 and 2 of 3", "below rung 1 of 3", "above rung 3 of 3"]
    assert rung_label(LadderState(), 512) == ""


def test_plot_scale_and_rows():
    assert [nice_ceiling(x) for x in (0, 0.3, 1, 1.2, 2.2, 3, 9.5, 95, 101)] == [1, 0.5, 1, 2, 2.5, 5, 10, 100, 200]
    assert bucket_max([1, 5, 2, 2, 9, 0], 3) == [5, 2, 9] and bucket_max([1, 2], 5) == [1, 2]
    assert plot_rows([0, 4, 8], 0, 8, 5, 1) == ["  ▁▄█"]  # newest right, blank left, 0 keeps a baseline
    assert plot_rows([0, 8, 16, 24], 0, 24, 4, 3) == ["   █", "  ██", "▁███"]
    assert plot_rows([50], 0, 10, 2, 1) == [" █"]  # clamped to the top
    assert [format_scale(1.0, "%"), format_scale(0.0, "%"), format_scale(100.0, "tok/s"), format_scale(2.5, "")] \
        == ["100%", "0%", "100 tok/s", "2.5"]
    h = RateHistory(3)
    for t in (10.0, 11.0, 12.5, 14.0):
        h.push(LiveRates(), t)
    assert h.span() == 4.0 - 1.0 and len(h) == 3


def test_top_takes_admin_token_flag():
    import argparse

    from ft.tui.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["top", "--admin-token", "a"]).token == "a"
    assert parser.parse_args(["top", "--token", "b"]).token == "b"


def test_the_help_explains_every_abbreviation_the_pools_show():
    """Issue 41, item 9: `res 74%` was explained nowhere, and the two hit rates looked alike."""
    from ft.tui.state import pool_usage
    from ft.tui.widgets.help import ABOUT

    state = CacheState()
    state.pools.kv.pages, state.pools.kv.used, state.pools.kv.cached = 100, 98, 90
    usage = pool_usage(state)
    words = {w.strip('"').rstrip(":") for line in usage.values() for w in line.split() if w.isalpha()}
    assert words >= {"hit", "res", "used", "cached"}
    for word in ("hit", "res", "used", "cached"):
        assert f'"{word}"' in ABOUT, word
    assert "lifetime" in ABOUT and "recent hits" in ABOUT and "cached prefixes" in ABOUT
    # KV after the requests ended: 8 pages held by requests, 90 by cached prefixes, shown apart
    assert usage["kv"] == "used 8/100 (8%) +90 cached"
    assert usage["moe"] == "hit 0.0% res -"
    state.pools.mamba.size, state.pools.mamba.used = 8, 2  # offloaded: cached prefixes' states in host memory
    state.pools.mamba.host_states, state.pools.mamba.host_bytes = 4, 4 * 115 * 2**20
    usage = pool_usage(state)
    assert usage["mamba"] == "used 2/8 +4 on host (460.0 MiB)"
    assert '"on host"' in ABOUT
