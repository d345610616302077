"""Snapshots of `ft top` (pytest-textual-snapshot) from fixed state payloads: the main screen, the
resize dialog with a fitting and an out-of-range target, and the unreachable banner, at 80x24
and 160x48. A fixed feed and a fake client: no server, no clock (times are rendered in UTC).
`pytest --snapshot-update` rewrites tests/__snapshots__/ after a deliberate change."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest
from textual.widgets import Input

pytest.importorskip("pytest_textual_snapshot")

from ft.schemas import CacheState, Event, History, LiveRates, PlanStep, ResizePlan  # noqa: E402
from ft.tui.app import make_app  # noqa: E402
from ft.tui.source import Status, Update  # noqa: E402
from ft.tui.state import check_targets, pools_of, unit_bytes  # noqa: E402

GiB = 1024**3
SIZES = [(80, 24), (160, 48)]

CACHE = {
    "state": "serving", "model": "Qwen3-Next-80B-A3B-NVFP4", "budget_bytes": int(4.8 * GiB),
    "allocated_bytes": int(4.1 * GiB), "context_limit": 262144,
    "pools": {
        "moe": {"size": 512, "bytes": int(1.3 * GiB), "min": 64, "max": 1843, "policy": "lru", "backend": "offload",
                "total_experts": 24576, "resident": 498, "hit_rate": 0.912, "hits": 91200, "misses": 8800},
        "kv": {"size": 98304, "bytes": int(1.9 * GiB), "min": 4096, "max": 262144, "page_size": 64, "pages": 1536,
               "used": 611},
        "mamba": {"size": 8, "bytes": int(0.9 * GiB), "min": 4, "max": 44, "used": 3},
    },
    "ladder": {"enabled": True, "auto": True, "rungs": [65536 + 32768 * i for i in range(7)], "current": 1,
               "step": 32768, "last_decision": "grow to 98304: request 7 needs 81920 tokens (prompt 61440 + max 20480)"},
    "running": 3, "waiting": 1, "uptime_s": 7384.0,
}
T0 = 1_760_000_000.0
HISTORY = {"entries": [
    {"id": 0, "time": T0, "trigger": "startup", "from": {}, "to": {"moe": 400, "kv": 65536, "mamba": 8},
     "peak_bytes": int(4.0 * GiB), "status": "ok", "phases": {"allocate_s": 1.2, "fill_s": 7.5, "total_s": 9.1}},
    {"id": 1, "time": T0 + 300, "trigger": "manual", "from": {"moe": 400, "kv": 65536, "mamba": 8},
     "to": {"moe": 1024, "kv": 65536, "mamba": 8}, "peak_bytes": int(4.6 * GiB), "status": "rolled_back",
     "error": "OutOfMemoryError('CUDA out of memory. Tried to allocate 800.00 MiB')",
     "phases": {"quiesce_s": 0.1, "free_s": 0.2, "allocate_s": 2.0, "total_s": 2.3}},
    {"id": 2, "time": T0 + 420, "trigger": "ladder", "reason": "grow to 98304: request 7 needs 81920 tokens",
     "from": {"moe": 624, "kv": 65536, "mamba": 8}, "to": {"moe": 512, "kv": 98304, "mamba": 8},
     "peak_bytes": int(4.1 * GiB), "measured_peak_bytes": int(4.05 * GiB), "status": "ok",
     "phases": {"quiesce_s": 0.05, "free_s": 0.11, "allocate_s": 0.31, "fill_s": 0.42, "graphs_s": 0.2,
                "total_s": 1.09}},
]}


def _rates(i: int) -> LiveRates:
    return LiveRates(decode_tokens_per_s=60 + 35 * math.sin(i / 5), expert_hit_rate=0.85 + 0.1 * math.sin(i / 9),
                     kv_usage=min(1.0, 0.2 + i / 150))


class FixedSource:
    """Feeds the app a fixed sequence, synchronously, then waits for ever."""

    def __init__(self, updates=(), status: Status | None = None):
        self.updates, self.status = list(updates), status

    async def run(self, on_update, on_status) -> None:
        if self.status is not None:
            on_status(self.status)
        for u in self.updates:
            on_update(u)
        await asyncio.Event().wait()


class FakeClient:
    """cache/history answer the fixed payloads; a dry run plans from the unit costs; a real
    resize or ladder move fails the test (the snapshots never act)."""

    def __init__(self):
        self.state = CacheState.model_validate(CACHE)

    def cache(self):
        return self.state

    def history(self):
        return History.model_validate(HISTORY)

    def resize(self, moe=None, kv=None, mamba=None, wait_s=None, dry_run=False):
        assert dry_run, "the snapshot tests never resize"
        targets = {k: v for k, v in {"moe": moe, "kv": kv, "mamba": mamba}.items() if v is not None}
        pools, total, steps = pools_of(self.state), self.state.allocated_bytes, []
        for name, t in sorted(targets.items(), key=lambda kv_: kv_[1] - pools[kv_[0]].size):
            delta = int((t - pools[name].size) * unit_bytes(pools[name]))
            total += delta
            steps.append(PlanStep(action=f"{'grow' if delta > 0 else 'shrink'} {name}", pool=name,
                                  delta_bytes=delta, total_bytes=total))
        problems = check_targets(self.state, targets)
        full = {k: targets.get(k, p.size) for k, p in pools.items()}
        return ResizePlan(target=full, steps=steps, peak_bytes=max([s.total_bytes for s in steps] or [total]),
                          budget_bytes=self.state.budget_bytes, fits=not problems, reason="; ".join(problems) or None)

    def ladder(self, auto=None, rung=None):
        raise AssertionError("the snapshot tests never move the ladder")


@pytest.fixture(autouse=True)
def utc():
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


def serving_app():
    cache = CacheState.model_validate(CACHE)
    history = History.model_validate(HISTORY)
    updates = [Update(Event(kind="snapshot" if i == 0 else "tick", cache=cache, rates=_rates(i)),
                      history if i == 0 else None) for i in range(90)]
    return make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(),
                    source=FixedSource(updates, Status(True, "fixed")))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen(snap_compare, size):
    assert snap_compare(serving_app(), terminal_size=size, run_before=lambda pilot: pilot.pause(0.2))


def _resize_to(kv: str):
    async def run_before(pilot):
        await pilot.pause(0.1)
        await pilot.press("r")
        await pilot.pause(0.1)
        for box in pilot.app.screen.query(Input):
            box.cursor_blink = False
        pilot.app.screen.query_one("#target-kv").value = kv
        await pilot.pause(0.6)  # the debounce, then the dry run
        await pilot.wait_for_scheduled_animations()
    return run_before


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kv", ["131072", "999999"], ids=["fits", "out_of_range"])
def test_resize_dialog(snap_compare, size, kv):
    assert snap_compare(serving_app(), terminal_size=size, run_before=_resize_to(kv))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_unreachable_banner(snap_compare, size):
    status = Status(False, "cannot reach the server at http://127.0.0.1:30000 (All connection attempts failed); "
                    "check the URL (--url / FT_URL) and that `ft serve` runs there", retry_in=4.0)
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), source=FixedSource([], status))
    assert snap_compare(app, terminal_size=size, run_before=lambda pilot: pilot.pause(0.2))
