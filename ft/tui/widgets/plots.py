"""Live plots: decode tokens/s, expert hit rate, KV usage and the engine's busy share (the time its
thread spent in steps: near 100% the server is saturated) over the last minutes, each a bar plot
with its scale: the axis's bottom and top with the unit (the shares on 0..100%, decode on 0 up to a
round number above the window's peak), the latest value, and the window's time span in the panel's
bottom border, with the server's slow steps in that window when there were any (a stall's count: the
server's log has a line for each, `ft.engine.core.slow_steps`)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget

from ft.tui.state import RateHistory, format_age, format_scale, nice_ceiling, plot_rows

# key, name, short name (narrow rows), unit ('%': a fraction 0..1), the window's extreme shown
# under the value (decode: its peak; hit rate: its worst; KV usage and busy: their peaks), colour
PLOTS = (("decode", "decode", "decode", "tok/s", "max", "#e5c07b"),
         ("hit_rate", "recent hits", "recent", "%", "min", "#c678dd"),  # (the pools panel's "hit" is lifetime)
         ("kv_usage", "kv usage", "kv", "%", "max", "#56b6c2"),
         ("busy", "engine busy", "busy", "%", "max", "#98c379"))
MIN_BARS = 6
GUTTER = 13  # the name / value / extreme column of a tall plot
AXIS = 12  # the axis labels of a tall plot, '┤' included: '10000 tok/s┤'


def value_text(v: float, unit: str) -> str:
    return f"{100.0 * v:.1f}%" if unit == "%" else f"{v:.1f} {unit}"


def scale_of(data: list[float], unit: str) -> tuple[float, float]:
    """The axis: 0..1 for a fraction, else 0 up to a round number at or above the peak."""
    return (0.0, 1.0) if unit == "%" else (0.0, nice_ceiling(max(data, default=0.0)))


class RatePlot(Widget):
    """One rate, as tall as the widget. One row: 'name value lo▕bars▏hi' (the value carries the
    unit); taller: the name, the value and the window's extreme on the left, then the axis (top
    and bottom labels with the unit, ┤ ticks) and the bars. Newest at the right."""

    def __init__(self, key: str, name: str, short: str, unit: str, extreme: str, color: str, **kw) -> None:
        super().__init__(**kw)
        self.key, self.label, self.short, self.unit, self.extreme, self.color = key, name, short, unit, extreme, color
        self.data: list[float] = []

    def show(self, data: list[float]) -> None:
        self.data = data
        self.refresh()

    def render(self) -> Text:
        width, height = max(1, self.size.width), max(1, self.size.height)
        lo, hi = scale_of(self.data, self.unit)
        value = value_text(self.data[-1] if self.data else 0.0, self.unit)
        t = Text(no_wrap=True, overflow="crop")
        if height == 1:
            return self._row(t, width, lo, hi, value)
        top, bottom = format_scale(hi, self.unit), format_scale(lo, "%" if self.unit == "%" else "")
        pick = max if self.extreme == "max" else min
        extreme = f"{self.extreme} {value_text(pick(self.data), self.unit).removesuffix(' ' + self.unit)}" \
            if self.data else ""  # the unit is the value's, just above
        bars_w = max(0, width - GUTTER - AXIS)
        rows = plot_rows(self.data, lo, hi, bars_w, height)
        left = [self.label, value, extreme] + [""] * height
        for r in range(height):
            t.append(f"{left[r]:<{GUTTER}}"[:GUTTER], "bold" if r == 0 else "dim" if r == 2 else "")
            mark = f"{top}┤" if r == 0 else f"{bottom}┤" if r == height - 1 else "│"
            t.append(f"{mark:>{AXIS}}", "dim")
            t.append(rows[r], self.color)
            if r < height - 1:
                t.append("\n")
        return t

    def _row(self, t: Text, width: int, lo: float, hi: float, value: str) -> Text:
        wide = width >= 60
        name = self.label if wide else self.short
        head = f"{name:<{12 if wide else 6}}{value:>12} "
        bottom = format_scale(lo, "%" if self.unit == "%" else "").rjust(2)
        top = format_scale(hi, "%" if self.unit == "%" else "")
        bars_w = width - len(head) - len(bottom) - 2 - len(top)
        if bars_w < MIN_BARS:  # no room for the scale: the value and the bars
            t.append(head[:width])
            t.append(plot_rows(self.data, lo, hi, max(0, width - len(head)), 1)[0], self.color)
            return t
        t.append(head)
        t.append(bottom + "▕", "dim")
        t.append(plot_rows(self.data, lo, hi, bars_w, 1)[0], self.color)
        t.append("▏" + top, "dim")
        return t


class RatePlots(Vertical):
    """The four plots; `show(history)` redraws them and puts the time span in the border."""

    def compose(self) -> ComposeResult:
        for key, *rest in PLOTS:
            yield RatePlot(key, *rest, id=f"plot-{key}", classes="plot")

    def show(self, history: RateHistory) -> None:
        series = history.series()
        for key, *_ in PLOTS:
            self.query_one(f"#plot-{key}", RatePlot).show(series[key])
        span = history.span()
        slow = history.slow_steps()
        slow_text = f" · {slow} slow step{'s' * (slow != 1)} (the server's log names each)" if slow else ""
        self.border_subtitle = (f"last {format_age(span)} → now" if len(history) > 1 else "") + slow_text
