"""The KV ladder, as a policy: KV grows rung by rung only when a request needs the context, and
shrinks back (with hysteresis) when a new, unrelated request no longer needs it. Every byte KV
does not use goes to expert slots, so short requests decode with more experts resident.

Rungs are 2 x step, 3 x step, ... up to the context limit (the last rung is the limit itself when
it is not a multiple). The ladder reads a small snapshot (`LadderSnapshot`) and answers with a
move or nothing; it never touches the engine. The engine runs the move as a rebuild at a step
boundary, before the first waiting request is admitted (so queue order is kept and a rebuild never
races a forward pass), and tells the ladder how it went (`moved`, `refused`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ft.errors import ConfigError


def make_rungs(step: int, limit: int, page_size: int) -> list[int]:
    """[2*step, 3*step, ..., limit] in tokens, each a whole number of pages."""
    if step < page_size or step % page_size:
        raise ConfigError(f"--ladder-step-size must be a positive multiple of the page size {page_size}, got {step}")
    rungs = list(range(2 * step, limit, step))
    rungs.append(-(-limit // page_size) * page_size)
    return rungs


@dataclass
class LadderOptions:
    step: int
    min_reuse: float  # a request reusing less than this fraction of its prompt may shrink the ladder
    dwell_s: float  # least time on a rung before shrinking
    grow_hold_s: float  # no shrink for this long after a grow


@dataclass(frozen=True)
class Head:
    """The first waiting request, as the ladder sees it."""

    request_id: str
    prompt_tokens: int
    possible_length: int  # prompt + its max new tokens
    reused_tokens: int  # prompt tokens the prefix cache would give it


@dataclass(frozen=True)
class LadderSnapshot:
    kv_tokens: int
    head: Head | None
    running_possible: int  # the running requests' possible lengths, summed
    can_admit: bool  # a running place is free for the head
    top_rung: int  # the highest rung whose geometry keeps every floor (-1: none)
    kv_floor: int = 0  # the KV a rebuild must keep: what running requests hold and each queued one needs


@dataclass(frozen=True)
class LadderMove:
    rung: int
    kv_tokens: int
    reason: str
    grow: bool
    request_id: str | None = None


class Ladder:
    def __init__(self, rungs: list[int], opts: LadderOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.rungs, self.opts, self.clock = rungs, opts, clock
        self.auto = True
        self.last_decision: str | None = None
        self._since = clock()  # when the current rung was reached
        self._last_grow = float("-inf")
        self._seen: set[str] = set()  # requests already decided on
        self._deferred: tuple[str, int] | None = None  # (request, running_possible) of a deferred grow

    # ----------------------------------------------------------------------------- state
    def current(self, kv_tokens: int) -> int | None:
        """Index of the rung KV is on, None when a manual resize left it between rungs."""
        return self.rungs.index(kv_tokens) if kv_tokens in self.rungs else None

    def step_index(self, direction: str, kv_tokens: int) -> int:
        cur = self.current(kv_tokens)
        if cur is None:  # between rungs: up is the first rung above, down the first below
            above = [i for i, r in enumerate(self.rungs) if r > kv_tokens]
            below = [i for i, r in enumerate(self.rungs) if r < kv_tokens]
            return (above[0] if above else len(self.rungs)) if direction == "up" else (below[-1] if below else -1)
        return cur + (1 if direction == "up" else -1)

    # ----------------------------------------------------------------------------- policy
    def decide(self, snap: LadderSnapshot) -> LadderMove | None:
        """Look at the first waiting request once: grow when it could reach the KV bound (to the
        highest rung that keeps the floors at most), shrink when it reuses little of the prefix
        cache and nothing running needs the current rung. None: stay."""
        head = snap.head
        if not self.auto or head is None or head.request_id in self._seen or not snap.can_admit:
            return None
        if self._deferred == (head.request_id, snap.running_possible):
            return None  # deferred until the running requests change
        # the head with the running ones, and never below what the queue behind it holds: a rebuild below
        # that floor is refused (the cache keeps every queued request servable), and the head would fail
        need = max(head.possible_length + snap.running_possible, snap.kv_floor - 1)
        kv = snap.kv_tokens
        fits = [i for i, r in enumerate(self.rungs) if r > need]
        target = fits[0] if fits else len(self.rungs) - 1  # at least one rung up when it would exactly fill
        if need >= kv and self.rungs[target] > kv:
            reason = f"grow: request {head.request_id} may need {need} tokens with the running ones"
            if target > snap.top_rung:
                top = self.rungs[snap.top_rung] if snap.top_rung >= 0 else 0
                if top <= kv:
                    self._seen.add(head.request_id)
                    self.last_decision = (f"{reason}; no higher rung keeps the expert floor (the highest that "
                                          f"does holds {top} tokens): stays at {kv}")
                    return None
                target = snap.top_rung
                reason += f"; clamped to {self.rungs[target]} tokens, the highest rung that keeps the expert floor"
            return LadderMove(target, self.rungs[target], reason, True, head.request_id)
        if self.rungs[target] < kv:
            return self._maybe_shrink(head, target, need)
        self._seen.add(head.request_id)
        return None

    def _maybe_shrink(self, head: Head, target: int, need: int) -> LadderMove | None:
        if head.reused_tokens >= self.opts.min_reuse * head.prompt_tokens:
            self._seen.add(head.request_id)
            return None  # the next turn of a conversation: keep its KV
        now = self.clock()
        if now - self._since < self.opts.dwell_s or now - self._last_grow < self.opts.grow_hold_s:
            self._seen.add(head.request_id)
            self.last_decision = (f"shrink to {self.rungs[target]} held back: dwell {self.opts.dwell_s:g} s, "
                                  f"hold after grow {self.opts.grow_hold_s:g} s")
            return None
        return LadderMove(target, self.rungs[target], f"shrink: request {head.request_id} reuses "
                          f"{head.reused_tokens} of {head.prompt_tokens} prompt tokens and may need {need}",
                          False, head.request_id)

    def holds(self, snap: LadderSnapshot) -> bool:
        """Whether the first waiting request is deferred (its grow could not run while the running
        requests are what they are): it waits, they go on."""
        return snap.head is not None and self._deferred == (snap.head.request_id, snap.running_possible)

    # ----------------------------------------------------------------------------- outcomes
    def moved(self, move: LadderMove, changed: bool) -> None:
        """The engine ran `move`."""
        if move.request_id is not None:
            self._seen.add(move.request_id)
        self.last_decision = move.reason
        if changed:
            self._since = self.clock()
            if move.grow:
                self._last_grow = self._since

    def refused(self, move: LadderMove, error: str, final: bool, running_possible: int = 0) -> None:
        """The engine could not run `move`; `final`: the request will not be asked about again,
        otherwise it is asked again once the running requests (`running_possible`) change."""
        if move.request_id is not None:
            if final:
                self._seen.add(move.request_id)
            else:
                self._deferred = (move.request_id, running_possible)
        self.last_decision = f"{move.reason}: not done ({error})"
