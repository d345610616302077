"""The help screen: what the dashboard shows and its keys."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

ABOUT = """\
header    the state, and how old the figures are ("updated 0.4 s ago", marked stale after three
          refresh intervals without an update); an answer older than the one shown is dropped
pools     each pool's size, bytes, usage and reachable range (min..max with the others fixed);
          the bar is the rebuild budget: each pool's share, then the free slack; under it,
          per pool: · below its minimum, █ what it holds, ━ the room it could grow into.
          moe "hit": the expert hit rate since the server started (lifetime; the live plot's
          "recent hits", "recent" when narrow, is the rate over each refresh interval); "res":
          the share of expert slots that hold an expert. kv "used": pages running requests
          hold; "cached": pages only cached prefixes hold (kept after requests end, reused by a
          next turn, given back when a request needs them); mamba "on host": cached prefixes
          whose linear-attention state waits in host memory (offloaded on one GPU), copied to a
          slot on a hit; the host n-gram table, if any, is host memory outside the budget.
          "card" (a CUDA server): the card's use by the driver's count, what of it the server
          never took, and the headroom the budget keeps back from the pools (--memory-ratio)
ladder    every KV rung (the current one marked), auto on/off, the last decision in full; rungs
          count from 1 ("rung 2/7"), as `ft ctl ladder --rung N` and the serve banner count them
live      decode tokens/s, expert hit rate and KV usage (pages held, cached prefixes included) per
          refresh interval, newest at the right: each axis's bottom and top with its unit; the time
          the plots span in the bottom border
requests  running, then waiting requests: state (waiting / prefill / decode), prompt and
          generated tokens, KV pages held, age
history   rebuilds newest first; the selected row's phases and error below the table
          (a short terminal shows the requests or the history: l and h switch)"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape", "close", "Close", id="help.close"),
        Binding("question_mark", "close", "Close", show=False, id="help.close2"),
    ]

    def __init__(self, keys: list[tuple[str, str]]) -> None:
        super().__init__()
        self.keys = keys

    def compose(self) -> ComposeResult:
        width = max((len(k) for k, _ in self.keys), default=1)
        keys = "\n".join(f"{k:>{width}}  {d}" for k, d in self.keys)
        with Vertical(id="help-dialog") as box:
            box.border_title = "ft top: help"
            yield Static(ABOUT, markup=False)
            yield Static(keys, id="help-keys", markup=False)

    def action_close(self) -> None:
        self.dismiss(None)
