"""`ft top`: the app and its factory `make_app`, shared by the CLI and the tests.

A thin composition root: the widgets (ft/tui/widgets) draw, `EventSource` (source.py) feeds
state, `AdminClient` (ft.ctl) acts; pure logic lives in state.py. Never imports torch.

Every answer that carries state (an event, a poll, an action's result) goes through `apply_cache`,
which drops one older than what is shown (`is_newer`), so the figures never go backwards, and
stamps the time of the last one applied, which the header shows as its age.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from ft.ctl.client import AdminClient, CtlError, default_token, default_url, normalize_url
from ft.ctl.format import format_change, format_geometry
from ft.schemas import CacheState, RequestList
from ft.tui.source import EventSource, Status, Update
from ft.tui.state import RateHistory, is_newer, rung_label
from ft.tui.widgets.banner import ConnectionBanner
from ft.tui.widgets.header import HeaderBar
from ft.tui.widgets.help import HelpScreen
from ft.tui.widgets.history import HistoryPanel
from ft.tui.widgets.ladder import LadderPanel
from ft.tui.widgets.plots import RatePlots
from ft.tui.widgets.pools import PoolsPanel
from ft.tui.widgets.rebuild import RebuildProgress
from ft.tui.widgets.requests import RequestsPanel
from ft.tui.widgets.resize import ResizeScreen


def _sizes(c: CacheState | None) -> dict[str, int]:
    if c is None:
        return {}
    return {"moe": c.pools.moe.size, "kv": c.pools.kv.size, "mamba": c.pools.mamba.size}


def _outcome(e: CtlError) -> str:
    """'refused', 'rolled back', 'not finished', 'unauthorized', ... from a CtlError's message."""
    return e.message.split(" (", 1)[0].split(":", 1)[0]


class FtTop(App):
    CSS_PATH = "styles.tcss"
    TITLE = "ft top"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    # short: the request list and the rebuild history take turns (l / h); tall: both
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]
    BINDINGS = [
        Binding("plus", "rung('up')", "Rung up", key_display="+", id="rung_up"),
        Binding("minus", "rung('down')", "Rung down", key_display="-", id="rung_down"),
        Binding("a", "toggle_auto", "Auto", id="toggle_auto"),
        # priority: handled the moment the app reads the key, not after a round trip through the
        # focused widget (by then the keys typed after it have gone to the main screen and are lost)
        Binding("r", "resize", "Resize", id="resize", priority=True),
        Binding("l", "requests", "Requests", id="requests"),
        Binding("h", "history", "History", id="history"),
        Binding("R", "retry", "Retry", key_display="R", id="retry"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
        Binding("q", "quit", "Quit", id="quit"),
    ]

    def __init__(self, client: Any, source: Any, url: str, rate_capacity: int = 240, refresh: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.client = client
        self.source = source
        self.url = url
        self.refresh_s = refresh
        self.clock = clock
        self.cache: CacheState | None = None
        self.requests: RequestList | None = None
        self.updated_at: float | None = None  # `clock()` when the state shown arrived
        self.dropped = 0  # answers older than the state shown, not applied
        self.rates = RateHistory(rate_capacity)
        self.connected = False
        self.unauthorized = False
        self.busy: str | None = None

    def compose(self) -> ComposeResult:
        yield HeaderBar(self.url, clock=self.clock, refresh=self.refresh_s, id="header")
        yield ConnectionBanner("", id="banner", markup=False)
        yield RebuildProgress(id="progress")
        yield PoolsPanel(id="pools")
        with Horizontal(id="middle"):
            yield LadderPanel(id="ladder")
            yield RatePlots(id="plots")
        with Vertical(id="bottom", classes="-show-requests"):
            yield RequestsPanel(id="requests")
            yield HistoryPanel(id="history")
        yield Footer(show_command_palette=False)  # ctrl+p still opens it: its room goes to the keys

    def on_mount(self) -> None:
        for wid, title in (("pools", "pools"), ("ladder", "kv ladder"), ("plots", "live"),
                           ("requests", "requests"), ("history", "rebuild history")):
            self.query_one(f"#{wid}").border_title = title
        self.run_worker(self.source.run(self.on_source_update, self.on_source_status), name="source",
                        group="source", exit_on_error=False)

    # -- state in ------------------------------------------------------------------------------

    def on_source_update(self, update: Update) -> None:
        if not self.connected:
            self._set_connected(True, False)
        self.query_one(ConnectionBanner).hide()
        if not self.apply_cache(update.event.cache):
            return  # out of order: its rates and lists are older than those shown too
        self.rates.push(update.event.rates, self.updated_at or 0.0)
        self.query_one(RatePlots).show(self.rates)
        if update.history is not None:
            self.query_one(HistoryPanel).set_history(update.history)
        if isinstance(update.requests, RequestList):
            if is_newer(update.requests, self.requests):
                self.requests = update.requests
                self.query_one(RequestsPanel).set_requests(update.requests)
        elif isinstance(update.requests, str):
            self.query_one(RequestsPanel).set_message(update.requests)

    def on_source_status(self, status: Status) -> None:
        self._set_connected(status.connected, status.unauthorized)
        if status.connected:
            self.query_one(ConnectionBanner).hide()
        else:
            self.query_one(ConnectionBanner).show(status.message, status.retry_in)
        self._show_state()

    def _set_connected(self, connected: bool, unauthorized: bool) -> None:
        changed = (connected, unauthorized) != (self.connected, self.unauthorized)
        self.connected, self.unauthorized = connected, unauthorized
        if changed:
            self.refresh_bindings()  # R shows only while disconnected

    def apply_cache(self, cache: CacheState) -> bool:
        """Show `cache` unless it is older than the state shown; whether it was applied."""
        if not is_newer(cache, self.cache):
            self.dropped += 1
            return False
        self.cache = cache
        self.updated_at = self.clock()
        self.query_one(PoolsPanel).cache = cache
        ladder = self.query_one(LadderPanel)
        ladder.kv_tokens = cache.pools.kv.size
        ladder.ladder = cache.ladder
        header = self.query_one(HeaderBar)
        header.cache = cache
        header.updated_at = self.updated_at
        self._show_state()
        return True

    def _show_state(self) -> None:
        header = self.query_one(HeaderBar)
        server_state = self.cache.state if self.cache else "connecting"
        if self.unauthorized:
            header.state = "unauthorized"
        elif not self.connected:
            header.state = "unreachable" if self.cache is not None else "connecting"
        else:
            header.state = "rebuilding" if self.busy else server_state
        progress = self.query_one(RebuildProgress)
        if self.busy or (self.connected and server_state == "rebuilding"):
            progress.start(self.busy or "started by the server")
        else:
            progress.stop()

    # -- actions ---------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "retry":
            return not self.connected  # hidden (and off) while connected
        if action == "resize":
            return len(self.screen_stack) == 1  # in a dialog, r is the dialog's key (a priority binding)
        return True

    def action_retry(self) -> None:
        retry = getattr(self.source, "retry_now", None)
        if retry is not None:
            retry()
            self.query_one(ConnectionBanner).show("trying again ...", 0.0)

    def action_rung(self, direction: str) -> None:
        self._act(f"rung {direction}", lambda: self.client.ladder(rung=direction))

    def action_toggle_auto(self) -> None:
        on = not (self.cache.ladder.auto if self.cache else False)
        self._act(f"auto {'on' if on else 'off'}", lambda: self.client.ladder(auto=on), rebuild=False)

    async def action_resize(self) -> None:
        if self.cache is None:
            self.notify("no state from the server yet", title="resize", severity="warning")
            return
        planner = lambda targets: self.client.resize(**targets, dry_run=True)  # noqa: E731
        # NOTE: awaited (and `r` is a priority binding, run as the app reads it): until the dialog is
        # mounted with its first box focused, the keys typed after `r` wait in the app's queue;
        # otherwise they go to the main screen's focused widget, or to a dialog with nothing focused,
        # and are lost
        await self.push_screen(ResizeScreen(self.cache, planner), callback=self._resize_chosen)

    def _resize_chosen(self, targets: dict[str, int] | None) -> None:
        if targets:
            self._act(f"resize to {format_geometry(targets)}", lambda: self.client.resize(**targets))

    def _show_bottom(self, which: str) -> None:
        bottom = self.query_one("#bottom")
        bottom.set_class(which == "requests", "-show-requests")
        bottom.set_class(which == "history", "-show-history")

    def action_requests(self) -> None:
        self._show_bottom("requests")
        self.query_one(RequestsPanel).focus_table()

    def action_history(self) -> None:
        self._show_bottom("history")
        self.query_one(HistoryPanel).focus_table()

    def action_help(self) -> None:
        keys = [(b.key_display or b.key, b.description) for b in self.BINDINGS if isinstance(b, Binding)]
        self.push_screen(HelpScreen(keys))

    def _act(self, what: str, call: Callable[[], CacheState], rebuild: bool = True) -> None:
        if self.busy:
            self.notify(f"{self.busy} is still running; wait for it", title="busy", severity="warning")
            return
        if rebuild:
            self.busy = what
            self._show_state()
        self.run_worker(self._run_action(what, call), group="action")

    async def _run_action(self, what: str, call: Callable[[], CacheState]) -> None:
        before = _sizes(self.cache)
        try:
            after = await asyncio.to_thread(call)
        except CtlError as e:
            self.notify(e.message, title=f"{what}: {_outcome(e)}", severity="error", timeout=8)
        else:
            self.apply_cache(after)  # dropped if a newer state came meanwhile
            where = rung_label(after.ladder, after.pools.kv.size) if after.ladder.enabled else ""
            self.notify(f"{what}: {format_change(before, _sizes(after))}" + (f"; now {where}" if where else ""),
                        title="ok")
        finally:
            self.busy = None
            self._show_state()
        try:
            self.query_one(HistoryPanel).set_history(await asyncio.to_thread(self.client.history))
        except CtlError:
            pass


def make_app(url: str | None = None, token: str | None = None, refresh: float = 1.0, client: Any = None,
             source: Any = None, clock: Callable[[], float] = time.monotonic) -> FtTop:
    """The dashboard for the server at `url` (default $FT_URL or http://127.0.0.1:30000).

    `client` acts (an `AdminClient`, or a fake with cache/history/resize/ladder, and requests when
    it has a request list); state streams from /admin/events when the client is an `AdminClient`
    (or None), else it is polled every `refresh` s from the client. `source` replaces the feed
    altogether (tests); `clock` (monotonic seconds) times the figures' age."""
    url = normalize_url(url or default_url())
    token = token if token is not None else default_token()
    stream = client is None or isinstance(client, AdminClient)
    if client is None:
        client = AdminClient(url, token)
    if source is None:
        source = EventSource(client, refresh, stream=stream, url=url, token=token)
    return FtTop(client, source, url, refresh=refresh, clock=clock)
