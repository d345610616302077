"""The ladder panel: every rung with the current one marked, auto on/off, and the last decision in
full (wrapped over as many lines as it takes). Rungs count from 1, as in `ft ctl` and the serve
banner."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ft.schemas import LadderState
from ft.tui.state import rung_label


def rungs_text(ladder: LadderState, width: int) -> Text:
    """All rungs as numbers when they fit on one line ('512 [768] 1024 ...'), else one mark per rung
    between the two ends ('512 ○●○○○○ 8192'), wrapped to `width`."""
    rungs, cur = ladder.rungs, ladder.current
    t = Text()
    words = [str(r) for r in rungs]
    if sum(len(w) + 1 for w in words) + 2 <= width:
        for i, w in enumerate(words):
            if i:
                t.append(" ")
            t.append(f"[{w}]" if i == cur else w, "bold reverse" if i == cur else "")
        return t
    t.append(f"{rungs[0]} ", "dim")
    for i in range(len(rungs)):
        t.append("●" if i == cur else "○", "bold yellow" if i == cur else "dim")
    t.append(f" {rungs[-1]}", "dim")
    return t


def last_text(ladder: LadderState) -> Text:
    """'last: ' and the last decision, whole: it wraps at word boundaries (a long word folds)."""
    t = Text(overflow="fold")
    t.append("last: ", "dim")
    t.append(" ".join((ladder.last_decision or "-").split()))
    return t


class LadderPanel(Widget):
    """`ladder` is the server's ladder; `kv_tokens` the KV size now (it may sit between rungs)."""

    ladder: reactive[LadderState | None] = reactive(None, layout=True)
    kv_tokens: reactive[int | None] = reactive(None)

    def render(self) -> Group:
        lad = self.ladder or LadderState()
        width = max(10, self.size.width)
        if not lad.enabled:
            return Group(Text("ladder off", "bold"), Text("start ft serve with --enable-kv-ladder", "dim"))
        head = Text(no_wrap=True, overflow="ellipsis")
        cur = lad.current
        if lad.rungs and cur is not None and 0 <= cur < len(lad.rungs):
            head.append(f"{rung_label(lad, lad.rungs[cur])} ")
            head.append(f"{lad.rungs[cur]} tok", "bold")
            head.append("  ")
        elif lad.rungs and self.kv_tokens is not None:
            head.append(f"{rung_label(lad, self.kv_tokens)}", "yellow")
            head.append("  ")
        head.append("auto ")
        head.append("on" if lad.auto else "off", "bold green" if lad.auto else "bold red")
        if lad.step:
            head.append(f"  step {lad.step}")
        lines = [head]
        if lad.rungs:
            lines.append(rungs_text(lad, width))
        lines.append(last_text(lad))
        return Group(*lines)
