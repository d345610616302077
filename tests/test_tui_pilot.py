"""`ft top` driven by Textual's Pilot. Against a real `ft serve` (the small checkpoint of conftest.py,
ladder on, 256-token step): `+` moves the server one rung up, `a` toggles auto, the resize dialog
refuses an out-of-range target without asking the server to resize and applies an in-range one;
every effect is checked through the admin API itself. Against fakes (tui_fakes.py; no server):
the age of the figures and its stale mark, out-of-order answers dropped, a 401 that stops the
retries until R, keys typed in a burst right after `r` while updates pour in, the request list,
the ladder's last reason wrapped in full. Every wait polls a condition."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from rich.text import Text
from server_proc import WAIT_S, ServerProcess
from textual import events
from tui_fakes import CACHE, REQUESTS, Clock, FakeClient, FixedSource, _rates

from ft.ctl.client import AdminClient, CtlError
from ft.schemas import CacheState, Event, RequestList
from ft.tui.app import make_app
from ft.tui.source import UNAUTHORIZED, EventSource, Status, Update
from ft.tui.widgets.header import STALE_STYLE
from ft.tui.widgets.resize import ResizeScreen


@pytest.fixture(scope="module")
def server(serve_checkpoint):
    srv = ServerProcess("--model", str(serve_checkpoint), "--enable-kv-ladder", "--ladder-step-size", "256",
                        "--ladder-dwell-s", "0", "--ladder-grow-hold-s", "0")
    yield srv
    srv.stop()


class CountingClient(AdminClient):
    """An AdminClient that records every resize that is not a dry run."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.applied: list[dict] = []

    def resize(self, moe=None, kv=None, mamba=None, wait_s=None, dry_run=False):
        if not dry_run:
            self.applied.append({"moe": moe, "kv": kv, "mamba": mamba})
        return super().resize(moe=moe, kv=kv, mamba=mamba, wait_s=wait_s, dry_run=dry_run)


def admin(server) -> dict:
    return server.get("/admin/cache").json()


def history_len(server) -> int:
    return len(server.get("/admin/cache/history").json()["entries"])


async def until(pilot, cond, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.1)


def test_keys_drive_the_server(server):
    client = CountingClient(server.url, timeout=WAIT_S)
    app = make_app(server.url, None, 0.5, client=client)
    notes: list[dict] = []
    notify = app.notify
    app.notify = lambda message, **kw: notes.append({**kw, "message": message}) or notify(message, **kw)

    async def scenario():
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.cache is not None and app.cache.state == "serving")
            start = admin(server)
            rung, rungs = start["ladder"]["current"], start["ladder"]["rungs"]

            await pilot.press("plus")  # one rung up
            await until(pilot, lambda: admin(server)["ladder"]["current"] == rung + 1)
            assert admin(server)["pools"]["kv"]["size"] == rungs[rung + 1]
            await until(pilot, lambda: app.busy is None)
            # rungs count from 1 on the screen, as in `ft ctl` and the banner (the API's index + 1)
            said = f"rung {rung + 2}/{len(rungs)}"
            await until(pilot, lambda: said in shown(app.query_one("#ladder")))
            assert any(said in str(n.get("message", "")) for n in notes), notes

            auto = admin(server)["ladder"]["auto"]
            await pilot.press("a")
            await until(pilot, lambda: admin(server)["ladder"]["auto"] is (not auto))
            await until(pilot, lambda: app.busy is None and app.cache.ladder.auto is (not auto))
            await pilot.press("a")
            await until(pilot, lambda: admin(server)["ladder"]["auto"] is auto)
            await until(pilot, lambda: app.cache.ladder.auto is auto)

            # out of range: refused in the dialog, the server never asked to resize
            before = history_len(server)
            await pilot.press("r")
            await until(pilot, lambda: type(app.screen).__name__ == "ResizeScreen")
            app.screen.query_one("#target-kv").value = "999999"
            await pilot.press("enter")
            await until(pilot, lambda: any(n.get("title") == "refused" for n in notes))  # Enter was handled
            assert client.applied == [] and history_len(server) == before
            assert type(app.screen).__name__ == "ResizeScreen"  # still open, showing why

            # the ranges follow the other fields: with KV at its minimum, mamba's range reaches further
            st = admin(server)
            app.screen.query_one("#target-kv").value = str(st["pools"]["kv"]["min"])

            def range_hi(name: str) -> int:
                return int(str(app.screen.query_one(f"#range-{name}").render()).split("..")[-1])

            await until(pilot, lambda: range_hi("mamba") > st["pools"]["mamba"]["max"])

            # in range: applied on Enter
            kv = admin(server)["pools"]["kv"]
            target = max(kv["min"], kv["size"] - 256)
            app.screen.query_one("#target-kv").value = str(target)
            await pilot.press("enter")
            await until(pilot, lambda: admin(server)["pools"]["kv"]["size"] == target)
            assert client.applied == [{"moe": None, "kv": target, "mamba": None}]
            assert history_len(server) == before + 1
            await until(pilot, lambda: app.busy is None)
            await pilot.press("q")

    asyncio.run(scenario())
    client.close()


# -- against fakes: no server -------------------------------------------------------------------


def shown(widget) -> str:
    """What the screen shows where `widget` is (its border and children included), as text lines."""
    strips = widget.screen._compositor.render_strips()
    r = widget.region  # border included
    return "\n".join(strip.text[r.x:r.right] for strip in strips[r.y:r.bottom])


def cache(**over) -> CacheState:
    return CacheState.model_validate({**CACHE, **over})


class IdleSource:
    """Connected, and then quiet: the test feeds the app itself (`app.on_source_update`)."""

    async def run(self, on_update, on_status) -> None:
        on_status(Status(True, "test"))
        await asyncio.Event().wait()


def update(uptime: float, started: float = CACHE["started_at"], requests=None, **over) -> Update:
    return Update(Event(kind="tick", cache=cache(uptime_s=uptime, started_at=started, **over), rates=_rates(0)),
                  None, requests)


def header_text(app) -> Text:
    return app.query_one("#header").render()


def test_staleness_mark_and_out_of_order_answers():
    clock = Clock()
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), source=IdleSource(), clock=clock)

    async def scenario():
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.1)
            assert "updated" not in header_text(app).plain  # nothing yet
            app.on_source_update(update(100.0))
            clock.t += 0.4
            await pilot.pause(0.3)  # the header redraws the age by itself
            t = header_text(app)
            assert "updated 0.4 s ago" in t.plain and "stale" not in t.plain
            clock.t += 2.5  # 2.9 s: under three refresh intervals
            assert "stale" not in header_text(app).plain
            clock.t += 0.3  # 3.2 s
            t = header_text(app)
            assert "stale: updated 3.2 s ago" in t.plain
            assert any(span.style == STALE_STYLE for span in t.spans)
            # an answer older than the one shown (uptime 99 < 100) is dropped: not shown, not fresh
            app.on_source_update(update(99.0, running=42))
            assert app.cache.uptime_s == 100.0 and app.dropped == 1 and "stale" in header_text(app).plain
            assert "running 42" not in header_text(app).plain and len(app.rates) == 1
            # so is an action's answer that comes back after a newer update
            app.on_source_update(update(105.0))
            assert not app.apply_cache(cache(uptime_s=104.0, started_at=CACHE["started_at"]))
            assert app.cache.uptime_s == 105.0 and "updated 0.0 s ago" in header_text(app).plain
            # a restarted server (another start time) starts over, even with a smaller uptime
            app.on_source_update(update(3.0, started=CACHE["started_at"] + 7000))
            assert app.cache.uptime_s == 3.0 and "up 3 s" in header_text(app).plain
            await pilot.press("q")

    asyncio.run(scenario())


class Unauthorized401:
    """An admin client whose server refuses the token; counts the asks. `authorized = True` fixes it."""

    def __init__(self):
        self.calls, self.authorized, self.fake = 0, False, FakeClient()

    def cache(self):
        self.calls += 1
        if not self.authorized:
            raise CtlError("unauthorized (401): the server needs an admin token; pass --token or set "
                           "FT_ADMIN_TOKEN", 1, 401)
        return self.fake.cache()

    def history(self):
        return self.fake.history()


class Down:
    """An admin client whose server cannot be reached; counts the tries."""

    def __init__(self):
        self.calls = 0

    def cache(self):
        self.calls += 1
        raise CtlError("cannot reach the server at http://127.0.0.1:9 (connection refused)", 3)

    def history(self):
        raise AssertionError("never reached")


def test_unauthorized_stops_retrying_until_asked():
    client = Unauthorized401()
    app = make_app("http://127.0.0.1:30000", None, 0.1, client=client)  # polls every 0.1 s

    async def scenario():
        async with app.run_test(size=(120, 40)) as pilot:
            banner = app.query_one("#banner")
            await until(pilot, lambda: banner.has_class("-shown"), 30)
            text = str(banner.render())
            assert text.startswith(UNAUTHORIZED) and "needs an admin token" in text and "R tries now" in text
            assert app.query_one("#header").state == "unauthorized"
            assert app.check_action("retry", ()) is True  # R is offered (and in the footer)
            await pilot.pause(2.0)  # reconnecting backoff would have asked 3 more times by now
            assert client.calls == 1
            await pilot.press("R")
            await until(pilot, lambda: client.calls == 2, 30)
            await pilot.pause(0.5)
            assert client.calls == 2 and banner.has_class("-shown")
            client.authorized = True
            await pilot.press("R")
            await until(pilot, lambda: app.cache is not None and not banner.has_class("-shown"), 30)
            assert app.query_one("#header").state == "serving"
            assert app.check_action("retry", ()) is False  # connected: R is off and hidden
            await pilot.press("q")

    asyncio.run(scenario())


def test_unreachable_keeps_retrying_with_backoff():
    client = Down()
    app = make_app("http://127.0.0.1:9", None, 0.1, client=client)

    async def scenario():
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: client.calls >= 3, 30)  # 0.5 s, then 1 s: no key needed
            assert str(app.query_one("#banner").render()).startswith("cannot reach")
            assert app.query_one("#header").state == "connecting"
            await pilot.press("q")

    asyncio.run(scenario())


def test_stream_401_waits_for_retry_now():
    """The event stream's 401: one status that says which token to set, then no new attempt until
    `retry_now()` (or the long wait)."""
    hits = []

    def answer(request: httpx.Request) -> httpx.Response:
        hits.append(request.headers.get("authorization"))
        return httpx.Response(401, json={"error": {"message": "admin routes need the admin token"}})

    source = EventSource(FakeClient(), 0.1, stream=True, url="http://127.0.0.1:30000", token="wrong",
                         transport=httpx.MockTransport(answer))
    statuses: list[Status] = []

    async def scenario():
        task = asyncio.create_task(source.run(lambda u: None, statuses.append))
        deadline = time.monotonic() + 30
        while not statuses:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)
        assert len(hits) == 1 and hits[0] == "Bearer wrong" and len(statuses) == 1
        st = statuses[0]
        assert st.unauthorized and not st.connected and st.retry_in >= 60
        assert st.message.startswith(UNAUTHORIZED) and "rejected the admin token" in st.message
        source.retry_now()
        while len(hits) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(scenario())


class PouringSource:
    """An update every 10 ms (uptime, sizes, ladder and history changing), like a busy server."""

    def __init__(self):
        self.count = 0

    async def run(self, on_update, on_status) -> None:
        from tui_fakes import HISTORY
        from ft.schemas import History

        on_status(Status(True, "test"))
        while True:
            i = self.count = self.count + 1
            c = cache(uptime_s=100.0 + i, state="rebuilding" if i % 5 == 1 else "serving")
            c.ladder.current = i % 7
            h = History.model_validate(HISTORY)
            h.entries[0].id = 100 + i
            on_update(Update(Event(kind="tick", cache=c, rates=_rates(i)), h,
                             RequestList.model_validate({**REQUESTS, "uptime_s": 100.0 + i})))
            await asyncio.sleep(0.01)


def box(app, pool: str) -> str | None:
    """The resize dialog's box for `pool`, None while the dialog is not there (yet)."""
    found = app.screen.query(f"#target-{pool}") if isinstance(app.screen, ResizeScreen) else []
    return found[0].value if found else None


def test_fast_typing_in_the_resize_dialog_while_updates_pour_in():
    """`r` then digits, Tab, digits, as one burst from the terminal (no wait between keys) while
    updates arrive every 10 ms: every key lands. The keys used to reach the dialog before its
    first box had the focus, and were dropped."""
    source = PouringSource()
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), source=source)

    async def scenario():
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: app.cache is not None, 30)
            for burst in range(3):
                before = source.count
                for key in ["r", "1", "0", "0", "0", "tab", "1", "3", "1", "0", "7", "2"]:
                    app.post_message(events.Key(key, key if len(key) == 1 else None))
                await until(pilot, lambda: box(app, "kv") == "131072", 30)
                screen = app.screen
                assert box(app, "moe") == "1000"  # typed over the selected 512
                # and typing on, a key at a time, while the updates go on
                for ch in "64":
                    app.post_message(events.Key(ch, ch))
                    await asyncio.sleep(0.02)
                await until(pilot, lambda: screen.query_one("#target-kv").value == "13107264", 30)
                assert source.count > before  # updates did arrive meanwhile
                await pilot.press("escape")
                await until(pilot, lambda: not isinstance(app.screen, ResizeScreen), 30)
            await pilot.press("q")

    asyncio.run(scenario())


def test_request_list():
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), source=IdleSource(), clock=Clock())

    async def scenario():
        async with app.run_test(size=(120, 30)) as pilot:  # short: the list and the history take turns
            panel, history = app.query_one("#requests"), app.query_one("#history")
            await pilot.pause(0.1)
            assert panel.display and not history.display  # the list comes first
            app.on_source_update(update(100.0, requests=RequestList.model_validate(REQUESTS)))
            await pilot.pause(0.1)
            table = app.query_one("#requests-table")
            rows = [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]
            assert rows == [["chatcmpl-7f3a9c1e2b4d", "decode", "61440", "1893", "990", "1m24s"],
                            ["cmpl-2e81d07a5c93", "decode", "512", "77", "10", "3.4 s"],
                            ["chatcmpl-0b9e4f6a8d21", "prefill", "30210", "0", "256", "0.6 s"],
                            ["chatcmpl-c4d2a17e9f05", "waiting", "2048", "0", "0", "0.2 s"]]
            assert panel.border_subtitle == "3 running · 1 waiting"
            assert "prompt tok" in shown(panel) and "kv pages" in shown(panel)
            await pilot.press("l")
            await pilot.press("down", "down")  # select the prefill one
            assert table.cursor_row == 2
            # the next list: the first request ended, the waiting one runs; the selection follows its row
            nxt = RequestList.model_validate({**REQUESTS, "uptime_s": 7390.0, "running": 3, "waiting": 0,
                                              "requests": [{**r, "state": "decode" if r["state"] == "waiting"
                                                            else r["state"]} for r in REQUESTS["requests"][1:]]})
            app.on_source_update(update(101.0, requests=nxt))
            await pilot.pause(0.1)
            assert table.row_count == 3 and str(table.get_row_at(table.cursor_row)[0]) == "chatcmpl-0b9e4f6a8d21"
            assert str(table.get_row_at(2)[1]) == "decode" and panel.border_subtitle == "3 running · 0 waiting"
            # an older list that arrives late is dropped
            app.on_source_update(update(102.0, requests=RequestList.model_validate(REQUESTS)))
            await pilot.pause(0.1)
            assert table.row_count == 3
            # none running: said so; a server without the route: said why
            app.on_source_update(update(103.0, requests=RequestList(uptime_s=7400.0,
                                                                    started_at=CACHE["started_at"])))
            await pilot.pause(0.1)
            assert table.row_count == 0 and "no requests running or waiting" in shown(panel)
            app.on_source_update(update(104.0, requests="this server has no request list"))
            await pilot.pause(0.1)
            assert "this server has no request list" in shown(panel)
            await pilot.press("h")  # the history takes the list's place
            await pilot.pause(0.1)
            assert history.display and not panel.display
            await pilot.press("q")

    asyncio.run(scenario())


def test_request_list_polled_from_the_client():
    """The real EventSource, polling: the list comes from the client's `requests()`; a server
    without the route (404) is asked once and said so."""

    class Old404(FakeClient):
        asked = 0

        def requests(self):
            Old404.asked += 1
            raise CtlError("not found (404): no /admin/requests", 1, 404)

    async def scenario(client, cond):
        app = make_app("http://127.0.0.1:30000", None, 0.1, client=client)
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: cond(app), 30)
            await pilot.pause(0.5)  # five more polls
            await pilot.press("q")
        return app

    app = asyncio.run(scenario(FakeClient(), lambda a: a.query_one("#requests-table").row_count == 4))
    assert app.requests == RequestList.model_validate(REQUESTS)
    asyncio.run(scenario(Old404(), lambda a: "no request list" in shown(a.query_one("#requests"))))
    assert Old404.asked == 1


LONG_REASON = ("grow: request chatcmpl-0b9e4f6a8d21 may need 215040 tokens with the running ones; clamped to "
               "229376 tokens, the highest rung that keeps the expert floor; then: not done (requests hold what "
               "the target needs; retried when they end)")


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_ladder_reason_wrapped_in_full(size):
    c = cache(uptime_s=100.0)
    c.ladder.last_decision = LONG_REASON
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), clock=Clock(),
                   source=FixedSource([Update(Event(kind="snapshot", cache=c))], Status(True, "test")))

    async def scenario():
        async with app.run_test(size=size) as pilot:
            await pilot.pause(0.2)
            text = shown(app.query_one("#ladder"))
            inside = " ".join(line.strip("│ ╭╮╰╯─") for line in text.splitlines())
            assert " ".join(("last: " + LONG_REASON).split()) in " ".join(inside.split())
            assert "…" not in text.split("last:")[1]  # nothing cut
            assert "rung 2/7 98304 tok" in text  # rungs count from 1 (the API's current is 1)
            await pilot.press("q")

    asyncio.run(scenario())


def test_the_history_details_follow_the_newest_entry_until_a_row_is_picked():
    """Issue 41, item 9: the details stayed on the entry that was newest when `ft top` started. They
    follow the newest rebuild while the cursor is on the top row; a row the user picked stays picked."""
    from textual.app import App
    from tui_fakes import HISTORY

    from ft.schemas import History
    from ft.tui.widgets.history import HistoryPanel

    def history(n: int) -> History:
        base = HISTORY["entries"][-1]
        return History.model_validate({"entries": [{**base, "id": i, "time": base["time"] + i} for i in range(n)]})

    class One(App):
        def compose(self):
            yield HistoryPanel(id="history")

    async def scenario():
        app = One()
        async with app.run_test(size=(120, 30)) as pilot:
            panel = app.query_one(HistoryPanel)
            details = app.query_one("#history-details")
            panel.set_history(history(2))
            await pilot.pause()
            assert str(details.render()).startswith("#1 ")
            panel.set_history(history(3))  # a new rebuild: the details move to it
            await pilot.pause()
            assert str(details.render()).startswith("#2 ")
            panel.focus_table()
            await pilot.press("down")  # the user picks the second row (#1) ...
            await pilot.pause()
            assert str(details.render()).startswith("#1 ")
            panel.set_history(history(4))  # ... which stays picked as #3 arrives
            await pilot.pause()
            assert str(details.render()).startswith("#1 ")

    asyncio.run(scenario())


async def open_resize_dialog(app, pilot) -> ResizeScreen:
    """Feed the app one update, press `r`, and return the resize dialog once its boxes are there."""
    app.on_source_update(update(100.0))
    await until(pilot, lambda: app.cache is not None, 30)
    await pilot.press("r")
    await until(pilot, lambda: box(app, "kv") is not None, 30)
    return app.screen


def test_the_resize_dialog_shows_the_range_its_refusal_names():
    """Issue 41, item 9: the kv range (others fixed) disagreed with the refusal under it (others as
    typed). With moe shrunk in the dialog, kv's label shows the range the refusal checks against."""
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), source=IdleSource(), clock=Clock())

    async def scenario():
        async with app.run_test(size=(160, 48)) as pilot:
            screen = await open_resize_dialog(app, pilot)
            screen.query_one("#target-moe").value = "64"  # frees expert slots: kv may grow past 262144
            screen.query_one("#target-kv").value = "99999999"
            await pilot.pause(0.1)
            refusal = str(screen.query_one("#resize-problems").render())
            label = str(screen.query_one("#range-kv").render())
            shown = label.split("range ")[1].split()[0]
            assert f"kv 99999999 is outside {shown}" in refusal, (refusal, label)
            assert shown != "4096..262144"  # not the range with moe at its size
            await pilot.press("escape")

    asyncio.run(scenario())


@pytest.mark.parametrize("width", [40, 61, 80, 97])
def test_the_connection_banner_wraps_between_words(width):
    """Issue 41, item 9 (the unreachable banner wrapped mid-word): at any width the banner's lines hold
    whole words of the message (a word longer than a line is the only one to break)."""
    message = ("cannot reach the server at http://127.0.0.1:30000 (All connection attempts failed); check the URL "
               "(--url / FT_URL) and that `ft serve` runs there")
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(),
                   source=FixedSource([], Status(False, message, retry_in=4.0)), clock=Clock())

    async def scenario():
        async with app.run_test(size=(width, 24)) as pilot:
            banner = app.query_one("#banner")
            await until(pilot, lambda: banner.has_class("-shown"), 30)
            await pilot.pause(0.1)
            lines = [strip.text.strip() for strip in banner.render_lines(banner.region.reset_offset)]
            words = (message + " (next try in 4.0 s; R tries now)").split()
            assert [w for line in lines for w in line.split()] == words, lines

    asyncio.run(scenario())


def test_a_dry_run_answering_after_the_dialog_closed_changes_nothing():
    """A dry run whose answer comes after its dialog closed (the input's debounce sent it while Enter's
    own dry run was out; Enter's answer closed the dialog): the answer used to be written into the closed
    dialog's widgets, and the worker's NoMatches took the whole app down (a CI run of
    `test_keys_drive_the_server`, session 52). Here the closed dialog's fetch is awaited directly."""
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), source=IdleSource(), clock=Clock())

    async def scenario():
        async with app.run_test(size=(160, 48)) as pilot:
            dialog = await open_resize_dialog(app, pilot)
            await pilot.press("escape")
            await until(pilot, lambda: not isinstance(app.screen, ResizeScreen), 30)
            assert await dialog._fetch_plan({"kv": 131072}) is None  # answered, shown nowhere
            await pilot.pause(0.1)
            assert app.is_running
            await pilot.press("q")

    asyncio.run(scenario())


def test_the_plots_border_counts_the_servers_slow_steps_in_its_window():
    """A tick whose interval had slow steps (`LiveRates.slow_steps`): the plots' bottom border counts them beside
    the window's span, and says where each is named (the server's log)."""
    from ft.schemas import LiveRates
    from ft.tui.widgets.plots import RatePlots

    ticks = [Update(Event(kind="tick", cache=cache(uptime_s=100.0 + i),
                          rates=LiveRates(decode_tokens_per_s=50.0, slow_steps=2 if i == 3 else 0)))
             for i in range(5)]
    app = make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), clock=Clock(),
                   source=FixedSource(ticks, Status(True, "test")))

    async def scenario():
        async with app.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: "slow" in str(app.query_one(RatePlots).border_subtitle), 30)
            assert str(app.query_one(RatePlots).border_subtitle).endswith(
                " · 2 slow steps (the server's log names each)")
            await pilot.press("q")

    asyncio.run(scenario())
