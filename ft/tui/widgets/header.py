"""The top line: server URL, model, state, uptime, running and waiting requests."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ft.schemas import CacheState
from ft.tui.state import format_uptime

STATE_STYLE = {"serving": "bold green", "rebuilding": "bold yellow", "starting": "bold cyan",
               "unreachable": "bold red", "connecting": "bold cyan"}


class HeaderBar(Widget):
    """One line; `state` is the server's state, or "unreachable" / "connecting" from the client."""

    cache: reactive[CacheState | None] = reactive(None)
    state: reactive[str] = reactive("connecting")

    def __init__(self, url: str, **kw) -> None:
        super().__init__(**kw)
        self.url = url

    def render(self) -> Text:
        c = self.cache or CacheState()
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(" ft top ", "bold reverse")
        t.append(f" {self.url}  ")
        if c.model:
            t.append(c.model, "bold")
            t.append("  ")
        t.append(self.state, STATE_STYLE.get(self.state, "bold"))
        if self.state not in ("unreachable", "connecting"):
            t.append(f"  up {format_uptime(c.uptime_s)}  running {c.running}  waiting {c.waiting}")
        if c.degraded:
            t.append(f"  DEGRADED: {c.degraded}", "bold red")
        return t
