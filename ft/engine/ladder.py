"""The KV ladder: KV grows rung by rung only when a request needs the context, and shrinks back
(with hysteresis) when a new, unrelated request no longer needs it. Every byte KV does not use
goes to expert slots, so short requests decode with more experts resident.

Rungs are 2 x step, 3 x step, ... up to the context limit (the last rung is the limit itself when
it is not a multiple). Decisions are taken on the engine thread, before a waiting request is
admitted, so queue order is kept and a rebuild never races a forward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ft.engine.errors import ConfigError


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


class Ladder:
    def __init__(self, engine, opts: LadderOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.opts, self.clock = engine, opts, clock
        self.rungs = make_rungs(opts.step, engine.context_limit, engine.config.page_size)
        self.auto = True
        self.last_decision: str | None = None
        self._since = clock()  # when the current rung was reached
        self._last_grow = float("-inf")
        self._seen: set[str] = set()  # requests already decided on

    # ----------------------------------------------------------------------------- state
    @property
    def current(self) -> int | None:
        """Index of the rung KV is on, None when a manual resize left it between rungs."""
        kv = self.engine.geometry.kv_tokens
        return self.rungs.index(kv) if kv in self.rungs else None

    def moe_for(self, kv_tokens: int) -> int:
        """Expert slots that fit beside `kv_tokens` of KV (an explicit --moe-cache-size or the
        resident backend keeps its own count: the ladder then only moves KV)."""
        e = self.engine
        if e.config.moe_backend == "resident" or e.config.moe_cache_size is not None:
            return e.geometry.moe_slots
        c, g = e.unit_costs, e.geometry
        left = e.budget.budget_bytes - g.mamba_slots * c.mamba_slot - (kv_tokens // c.page_size) * c.kv_page
        return max(0, min(e.total_experts, left // c.expert_slot)) if c.expert_slot else 0

    # ----------------------------------------------------------------------------- moves
    def go_to(self, index: int, reason: str) -> dict:
        """Rebuild to rung `index` (raises RebuildRefused / RebuildFailed like any rebuild)."""
        if not 0 <= index < len(self.rungs):
            from ft.engine.engine import RebuildRefused

            raise RebuildRefused(f"rung {index} is outside 0..{len(self.rungs) - 1}", self.engine.reachable_ranges())
        kv = self.rungs[index]
        old = self.engine.geometry.kv_tokens
        try:
            entry = self.engine.rebuild(moe=self.moe_for(kv), kv=kv, trigger="ladder", reason=reason)
        except Exception as e:
            self.last_decision = f"{reason}: not done ({e})"
            raise
        self.last_decision = reason
        if entry["to"] != entry["from"]:
            self._since = self.clock()
            if kv > old:
                self._last_grow = self._since
        return entry

    def step_index(self, direction: str) -> int:
        cur = self.current
        if cur is None:  # between rungs: up is the first rung above, down the first below
            kv = self.engine.geometry.kv_tokens
            above = [i for i, r in enumerate(self.rungs) if r > kv]
            below = [i for i, r in enumerate(self.rungs) if r < kv]
            return (above[0] if above else len(self.rungs)) if direction == "up" else (below[-1] if below else -1)
        return cur + (1 if direction == "up" else -1)

    # ----------------------------------------------------------------------------- automatic
    def before_admission(self) -> None:
        """Look at the first waiting request once: grow when it could reach the KV bound, shrink
        when it reuses little of the prefix cache and nothing running needs the current rung."""
        sched = self.engine.scheduler
        if not self.auto or not sched.waiting:
            return
        seq = sched.waiting[0]
        if seq.request_id in self._seen or len(sched.running) >= sched.max_running:
            return
        self._seen.add(seq.request_id)
        need = seq.possible_length + sum(s.possible_length for s in sched.running)
        kv = self.engine.geometry.kv_tokens
        fits = [i for i, r in enumerate(self.rungs) if r > need]
        target = fits[0] if fits else len(self.rungs) - 1  # at least one rung up when it would exactly fill
        if need >= kv and self.rungs[target] > kv:
            self._try(target, f"grow: request {seq.request_id} may need {need} tokens with the running ones")
        elif self.rungs[target] < kv:
            self._maybe_shrink(seq, target, need)

    def _maybe_shrink(self, seq, target: int, need: int) -> None:
        match = self.engine.prefix_cache.match(seq.token_ids)
        reused = match.num_tokens if match else 0
        if reused >= self.opts.min_reuse * len(seq.prompt_ids):
            return  # the next turn of a conversation: keep its KV
        now = self.clock()
        if now - self._since < self.opts.dwell_s or now - self._last_grow < self.opts.grow_hold_s:
            self.last_decision = (f"shrink to {self.rungs[target]} held back: dwell {self.opts.dwell_s:g} s, "
                                  f"hold after grow {self.opts.grow_hold_s:g} s")
            return
        self._try(target, f"shrink: request {seq.request_id} reuses {reused} of {len(seq.prompt_ids)} prompt "
                          f"tokens and may need {need}")

    def _try(self, index: int, reason: str) -> None:
        from ft.engine.engine import RebuildRefused
        from ft.engine.rebuild import RebuildFailed

        try:
            self.go_to(index, reason)
        except (RebuildRefused, RebuildFailed):
            pass  # recorded in last_decision (and the history for a rollback); keep serving
