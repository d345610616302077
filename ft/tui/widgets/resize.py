"""The resize dialog: targets for moe / kv / mamba, the server's dry-run plan as you type
(debounced), refusal of out-of-range targets without asking the server to resize, apply on Enter.
No keystroke typed fast is lost: `r` opens the dialog as the app reads it (a priority binding),
the app awaits the dialog's mount before it reads the next key, the first box has the focus from
the moment the dialog is composed, and Tab moves the focus as the app reads it (priority too)."""

from __future__ import annotations

import asyncio
from typing import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.timer import Timer
from textual.widgets import Input, Label, Static

from ft.ctl.client import CtlError
from ft.ctl.format import POOL_ORDER, format_plan, format_range
from ft.schemas import CacheState, ResizePlan
from ft.tui.state import check_targets, parse_target, pools_of, rung_label, target_ranges

DEBOUNCE_S = 0.3
UNITS = {"moe": "slots", "kv": "tokens", "mamba": "slots"}
Targets = dict[str, int]


class ResizeScreen(ModalScreen[Targets | None]):
    """Dismisses with the changed targets (pool -> size) once the dry run says they fit, or None.

    `planner(targets)` is the dry run (blocking; it runs in a thread): a `ResizePlan` or a
    `CtlError`."""

    BINDINGS = [
        Binding("escape", "cancel", "Cancel", id="resize.cancel"),
        # priority: Tab moves the focus as the app reads it, so the digits typed after it go to the
        # next box (a plain binding runs only after the key comes back from the focused box, when
        # the digits behind it have already gone to the box Tab was leaving)
        Binding("tab", "app.focus_next", show=False, priority=True, id="resize.next"),
        Binding("shift+tab", "app.focus_previous", show=False, priority=True, id="resize.previous"),
    ]
    AUTO_FOCUS = ".resize-input"  # focused while the screen composes, before any key reaches it

    def __init__(self, state: CacheState, planner: Callable[[Targets], ResizePlan]) -> None:
        super().__init__()
        self.state = state
        self.planner = planner
        self._timer: Timer | None = None
        self._plan: tuple[Targets, ResizePlan] | None = None

    def compose(self) -> ComposeResult:
        pools = pools_of(self.state)
        with Vertical(id="resize-dialog") as box:
            box.border_title = "resize pools"
            for name in POOL_ORDER:
                p = pools[name]
                with Horizontal(classes="resize-row"):
                    yield Label(name, classes="resize-name")
                    yield Input(str(p.size), id=f"target-{name}", classes="resize-input", restrict=r"[0-9_,]*")
                    yield Label(self._range_text(name, p.min, p.max, p.size), id=f"range-{name}",
                                classes="resize-range")
            yield Static("", id="resize-problems", markup=False)
            yield Static("", id="resize-plan", markup=False)
            yield Label("Enter apply  ·  Esc cancel", id="resize-hint")

    def on_mount(self) -> None:
        self._refresh_local()

    def _range_text(self, name: str, lo: int, hi: int, target: int | None) -> str:
        """'tokens  range 4096..262144', and for kv where the target sits on the ladder (rungs
        count from 1, as everywhere)."""
        text = f"{UNITS[name]}  range {format_range(lo, hi)}"
        if name == "kv" and target is not None and self.state.ladder.enabled:
            where = rung_label(self.state.ladder, target)
            text += f"  {where}" if where else ""
        return text

    # -- targets ---------------------------------------------------------------------------

    def targets(self) -> Targets:
        """The changed targets (a pool left at its size, or blank, is not sent). Raises ValueError."""
        pools = pools_of(self.state)
        out = {}
        for name in POOL_ORDER:
            raw = self.query_one(f"#target-{name}", Input).value
            try:
                t = parse_target(raw)
            except ValueError:
                raise ValueError(f"{name}: not a whole number: {raw!r}") from None
            if t is not None and t != pools[name].size:
                out[name] = t
        return out

    def _problems(self) -> tuple[Targets | None, list[str]]:
        try:
            targets = self.targets()
        except ValueError as e:
            return None, [str(e)]
        return targets, check_targets(self.state, targets)

    def _refresh_local(self) -> list[str]:
        targets, problems = self._problems()
        box = self.query_one("#resize-problems", Static)
        box.update(Text("\n".join(f"refused: {p}" for p in problems), "bold red") if problems else "")
        if targets == {}:
            self.query_one("#resize-plan", Static).update("no change")
        return problems

    # -- the dry run -------------------------------------------------------------------------

    def _typed(self) -> dict[str, int | None]:
        """Each box's target as typed (None: blank or not a number: the pool kept)."""
        out = {}
        for name in POOL_ORDER:
            try:
                out[name] = parse_target(self.query_one(f"#target-{name}", Input).value)
            except ValueError:
                out[name] = None
        return out

    def _show_ranges(self, ranges: dict[str, tuple[int, int]]) -> None:
        """Each pool's range with the others as typed: the ranges the refusals and the server check."""
        typed, pools = self._typed(), pools_of(self.state)
        for name, (lo, hi) in ranges.items():
            if name in UNITS:
                target = typed.get(name)
                self.query_one(f"#range-{name}", Label).update(
                    self._range_text(name, lo, hi, pools[name].size if target is None else target))

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._plan = None
        # the local estimate at once (what `check_targets` refuses against), the dry run's when it comes
        self._show_ranges(target_ranges(self.state, self._typed()))
        if self._timer is not None:
            self._timer.stop()
        if self._refresh_local():
            self.query_one("#resize-plan", Static).update("")
            return
        self._timer = self.set_timer(DEBOUNCE_S, self._plan_now)

    def _plan_now(self) -> None:
        targets, problems = self._problems()
        if targets and not problems:
            self.run_worker(self._fetch_plan(targets), exclusive=True, group="plan")

    async def _fetch_plan(self, targets: Targets) -> ResizePlan | None:
        try:
            plan = await asyncio.to_thread(self.planner, targets)
        except CtlError as e:
            plan, error = None, e
        else:
            error = None
        if not self.is_attached:
            # NOTE: the dialog closed while the dry run was out (e.g. the input's debounce sent one while
            # Enter's own closed the dialog): its widgets are gone, and a query would fail the worker,
            # which takes the app down
            return None
        if error is not None:
            self.query_one("#resize-plan", Static).update(Text(error.message, "red"))
            return None
        if self._problems()[0] != targets:  # NOTE: stale: the inputs changed meanwhile
            return None
        self._plan = (targets, plan)
        self._show_ranges({k: tuple(v) for k, v in plan.ranges.items()})  # (each with the other pools as typed)
        style = "" if plan.fits else "bold red"
        self.query_one("#resize-plan", Static).update(Text(format_plan(plan), style))
        return plan

    # -- apply / cancel -------------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.run_worker(self._apply(), exclusive=True, group="apply")

    async def _apply(self) -> None:
        targets, problems = self._problems()
        if problems or targets is None:
            self._refresh_local()
            self.notify("; ".join(problems), title="refused", severity="error")
            return
        if not targets:
            self.dismiss(None)
            return
        plan = self._plan[1] if self._plan and self._plan[0] == targets else await self._fetch_plan(targets)
        if plan is None:
            return
        if not plan.fits:
            self.notify(plan.reason or "the plan does not fit the budget", title="refused", severity="error")
            return
        self.dismiss(targets)

    def action_cancel(self) -> None:
        self.dismiss(None)
