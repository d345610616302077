"""Live plots: decode tokens/s, expert hit rate and KV usage over the last minutes (Sparklines)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, Sparkline

from ft.tui.state import RateHistory

PLOTS = (("decode", "decode"), ("hit_rate", "expert hits"), ("kv_usage", "kv usage"))


def _value(key: str, v: float) -> str:
    return f"{v:7.1f} tok/s" if key == "decode" else f"{100.0 * v:7.1f} %"


class RatePlots(Vertical):
    """One row per rate: its name and latest value, then a Sparkline of the ring buffer."""

    def compose(self) -> ComposeResult:
        for key, name in PLOTS:
            with Horizontal(classes="plot-row"):
                yield Label(f"{name:<11} {_value(key, 0.0)}", id=f"plot-label-{key}", classes="plot-label")
                yield Sparkline([], id=f"plot-{key}", summary_function=max)

    def show(self, history: RateHistory) -> None:
        for key, name in PLOTS:
            data = history.series()[key]
            last = data[-1] if data else 0.0
            self.query_one(f"#plot-label-{key}", Label).update(f"{name:<11} {_value(key, last)}")
            # NOTE: a constant 0 floor keeps an idle series flat at the bottom instead of mid-height
            self.query_one(f"#plot-{key}", Sparkline).data = [0.0, *data] if data else []
