"""Snapshots of `ft top` (pytest-textual-snapshot) from fixed state payloads: the main screen, the
resize dialog with a fitting and an out-of-range target, the unreachable banner, and stale
figures behind the unauthorized banner, at 80x24 and 160x48 (at 80x24 the request list and the
rebuild history take turns: both are shot). A fixed feed, a fake client and a fake clock: no
server, no real time (times are rendered in UTC). `pytest --snapshot-update` rewrites
tests/__snapshots__/ after a deliberate change."""

from __future__ import annotations

import os
import time

import pytest
from textual.widgets import Input

pytest.importorskip("pytest_textual_snapshot")

from tui_fakes import Clock, FakeClient, FixedSource, serving_app  # noqa: E402

from ft.tui.app import make_app  # noqa: E402
from ft.tui.source import UNAUTHORIZED, Status  # noqa: E402

SIZES = [(80, 24), (160, 48)]


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


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_main_screen(snap_compare, size):
    assert snap_compare(serving_app(), terminal_size=size, run_before=lambda pilot: pilot.pause(0.2))


def test_main_screen_history_turn(snap_compare):
    """80x24: `h` puts the rebuild history where the request list was."""
    async def run_before(pilot):
        await pilot.pause(0.2)
        await pilot.press("h")
        await pilot.pause(0.2)
    assert snap_compare(serving_app(), terminal_size=(80, 24), run_before=run_before)


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_stale_behind_unauthorized(snap_compare, size):
    """The figures came 12 s ago, then the server refused the token: the age is marked stale, the
    banner says which token to set, and R is offered instead of endless retries."""
    clock = Clock()
    app = serving_app(clock)

    async def run_before(pilot):
        await pilot.pause(0.2)
        clock.t += 12.0
        app.on_source_status(Status(False, f"{UNAUTHORIZED}: the server needs an admin token (HTTP 401)",
                                    retry_in=60.0, unauthorized=True))
        await pilot.pause(0.4)
    assert snap_compare(app, terminal_size=size, run_before=run_before)


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
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), source=FixedSource([], status),
                   clock=Clock())
    assert snap_compare(app, terminal_size=size, run_before=lambda pilot: pilot.pause(0.2))
