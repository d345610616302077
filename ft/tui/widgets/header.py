"""The top line: server URL, model, state, how old the figures are, uptime, running and waiting
requests. What does not fit the width goes, least useful first (URL, then model, ...)."""

from __future__ import annotations

import time
from typing import Callable

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ft.schemas import CacheState
from ft.tui.state import format_age, format_uptime, is_stale

STATE_STYLE = {"serving": "bold green", "rebuilding": "bold yellow", "starting": "bold cyan",
               "unreachable": "bold red", "connecting": "bold cyan", "unauthorized": "bold red"}
STALE_STYLE = "bold black on yellow"
OFFLINE = ("unreachable", "connecting", "unauthorized")
TICK_S = 0.2  # how often the age is redrawn


class HeaderBar(Widget):
    """One line; `state` is the server's state, or "unreachable" / "connecting" / "unauthorized"
    from the client. `updated_at` is when the figures shown arrived (the app's clock; None: none
    yet): their age is shown, marked stale past `is_stale(age, refresh)`."""

    cache: reactive[CacheState | None] = reactive(None)
    state: reactive[str] = reactive("connecting")
    updated_at: reactive[float | None] = reactive(None)

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic, refresh: float = 1.0, **kw) -> None:
        super().__init__(**kw)
        self.url = url
        self.clock = clock
        self.refresh_s = refresh

    def on_mount(self) -> None:
        self.set_interval(TICK_S, self.refresh)

    def age(self) -> float | None:
        return None if self.updated_at is None else max(0.0, self.clock() - self.updated_at)

    def stale(self) -> bool:
        age = self.age()
        return age is not None and is_stale(age, self.refresh_s)

    def parts(self) -> list[tuple[int, str, str]]:
        """(priority, text, style) in display order; the lowest priority is dropped first."""
        c = self.cache or CacheState()
        out = [(9, " ft top ", "bold reverse"), (1, f" {self.url} ", "")]
        if c.model:
            out.append((2, f" {c.model} ", "bold"))
        out.append((9, f" {self.state} ", STATE_STYLE.get(self.state, "bold")))
        age = self.age()
        if age is not None:
            if self.stale():
                out.append((8, f" stale: updated {format_age(age)} ago ", STALE_STYLE))
            else:
                out.append((7, f" updated {format_age(age)} ago ", "dim"))
        if self.cache is not None and self.state not in OFFLINE:
            out.append((4, f" up {format_uptime(c.uptime_s)} ", ""))
            out.append((5, f" running {c.running}  waiting {c.waiting} ", ""))
        if c.degraded:
            out.append((8, f" DEGRADED: {c.degraded} ", "bold red"))
        return out

    def render(self) -> Text:
        parts = self.parts()
        width = self.size.width or 80
        while len(parts) > 2 and sum(len(t) for _, t, _ in parts) > width:
            parts.remove(min(parts, key=lambda p: p[0]))
        t = Text(no_wrap=True, overflow="ellipsis")
        for _, text, style in parts:
            t.append(text, style)
        return t
