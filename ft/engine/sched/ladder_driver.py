"""Runs the ladder policy against the engine's parts: builds its snapshot, turns a move into a
rebuild (expert slots from the cache manager's arithmetic, never below the floor), and decides
what happens to the first waiting request when a grow cannot run (deferred while others run,
rejected with the reason when nothing runs or its prompt can never fit)."""

from __future__ import annotations

from typing import Callable

from ft.engine.cache.manager import CacheManager
from ft.engine.sched.ladder import Head, Ladder, LadderMove, LadderSnapshot
from ft.engine.sched.prefix_cache import PrefixCache
from ft.engine.sched.scheduler import Scheduler
from ft.engine.base.sequence import Sequence
from ft.errors import RebuildFailed, RebuildRefused


class LadderDriver:
    def __init__(self, ladder: Ladder, cache: CacheManager, scheduler: Scheduler, prefix_cache: PrefixCache) -> None:
        self.ladder, self.cache, self.scheduler, self.prefix_cache = ladder, cache, scheduler, prefix_cache
        self._refused_at: int | None = None  # the KV size at which a grow while decoding was refused
        self._top: tuple | None = None  # (geometry, budget, rungs) -> top rung, see `top_rung`

    def snapshot(self) -> LadderSnapshot:
        sched = self.scheduler
        head = None
        if sched.waiting:
            seq = sched.waiting[0]
            match = self.prefix_cache.match(seq.token_ids)
            head = Head(seq.request_id, len(seq.prompt_ids), seq.planned_length, match.num_tokens if match else 0)
        return LadderSnapshot(self.cache.geometry.kv_tokens, head, sum(s.planned_length for s in sched.running),
                              len(sched.running) < sched.max_running and not sched.admission_paused, self.top_rung(),
                              self.cache.limits().floor["kv"] if head is not None else 0)

    def top_rung(self) -> int:
        """The highest rung whose geometry keeps the expert floor (-1: none). Memoized per geometry
        and budget (each rung is a binary search over slot counts: ~100 layout sums; every step
        asks, through the admission snapshot)."""
        key = (self.cache.geometry, self.cache.budget.budget_bytes, tuple(self.ladder.rungs))
        if self._top is None or self._top[0] != key:
            top = max((i for i, r in enumerate(self.ladder.rungs) if self.cache.moe_beside(r) is not None), default=-1)
            self._top = (key, top)
        return self._top[1]

    def before_decode(self) -> None:
        """Grow while requests decode: when the running requests' next tokens need more KV pages than
        are free (after evicting prefix-cache entries), move one rung up, at most to the highest rung
        that keeps the expert floor. Open-ended requests are admitted at the current rung and reach
        the context they use this way. A refused or failed grow is recorded once per geometry; the
        scheduler then preempts as it would without a ladder."""
        sched, kv = self.scheduler, self.cache.pools.kv
        if not self.ladder.auto or not sched.running:
            return
        need = sum(max(0, kv.pages_for(s.num_computed + 1) - len(s.pages)) for s in sched.running
                   if s.num_uncomputed == 1)
        if need == 0 or self.prefix_cache.evict_for(pages=need):
            return
        cur = self.cache.geometry.kv_tokens
        if self._refused_at == cur:
            return
        top = self.top_rung()
        above = [i for i, r in enumerate(self.ladder.rungs) if r > cur and i <= top]
        if not above:
            return
        target = above[0]
        move = LadderMove(target, self.ladder.rungs[target], f"grow while decoding: the running requests need "
                          f"{need} more KV pages than are free", True)
        try:
            self._run(move)
        except (RebuildRefused, RebuildFailed) as e:
            self._refused_at = cur  # (in the history already: `_run` and the rebuild record refusals)
            self.ladder.refused(move, str(e), True)

    def before_admission(self, fail: Callable[[Sequence, str], Sequence]) -> list[Sequence]:
        """Ask the ladder; run its move before admission. A grow that cannot run defers the
        request while others run (they may free what it needs) and rejects it, with the reason,
        when nothing runs; the refusal is in history either way."""
        snap = self.snapshot()
        move = self.ladder.decide(snap)
        if move is None:
            self.scheduler.hold_head = self.ladder.holds(snap)
            return self._reject_if_never_fits(snap, fail)
        try:
            self._run(move)
        except (RebuildRefused, RebuildFailed) as e:
            final = not move.grow or not self.scheduler.running
            self.ladder.refused(move, str(e), final, snap.running_possible)
            if move.grow and not final:
                self.scheduler.hold_head = True  # deferred: the running requests go on
            elif move.grow:
                seq = self.scheduler.waiting[0]
                return [fail(seq, f"the KV ladder could not grow for this request: {e}")]
        return []

    def _reject_if_never_fits(self, snap: LadderSnapshot, fail) -> list[Sequence]:
        """A head whose prompt cannot fit even the highest rung that keeps the expert floor."""
        if snap.head is None or snap.top_rung < 0:
            return []
        top = self.ladder.rungs[snap.top_rung]
        if snap.head.prompt_tokens + 1 <= max(top, snap.kv_tokens):
            return []
        seq = self.scheduler.waiting[0]
        reason = (f"the prompt is {snap.head.prompt_tokens} tokens; the highest KV rung that keeps the expert "
                  f"floor holds {top} tokens")
        self.cache.record("ladder", f"reject request {seq.request_id}: {reason}", "refused", reason)
        return [fail(seq, reason)]

    def _run(self, move: LadderMove) -> dict:
        moe = self.cache.moe_beside(move.kv_tokens)
        if moe is None:
            why = f"rung {move.rung + 1} ({move.kv_tokens} tokens) leaves less than the expert floor {self.cache.expert_floor}"
            self.cache.record("ladder", move.reason, "refused", why)
            raise RebuildRefused(why, self.cache.reachable_ranges())
        entry = self.cache.rebuild(moe=moe, kv=move.kv_tokens, trigger="ladder", reason=move.reason)
        self.ladder.moved(move, entry["to"] != entry["from"])
        return entry

    def move(self, rung: int | str, reason: str | None = None) -> dict:
        """A manual rung move: an index, "up" or "down" (RebuildRefused / RebuildFailed like any
        rebuild)."""
        kv = self.cache.geometry.kv_tokens
        index = self.ladder.step_index(rung, kv) if isinstance(rung, str) else rung
        n = len(self.ladder.rungs)
        # NOTE: users count rungs from 1 (`ft ctl ladder --rung`, `ft top`, the banner); the API takes indices
        if not 0 <= index < n:
            raise RebuildRefused(f"rung {index + 1} is outside 1..{n} (the API's `rung` is the index {index}, "
                                 f"outside 0..{n - 1})", self.cache.reachable_ranges())
        said = rung if isinstance(rung, str) else index + 1
        move = LadderMove(index, self.ladder.rungs[index], reason or f"manual: rung {said}", self.ladder.rungs[index] > kv)
        try:
            return self._run(move)
        except (RebuildRefused, RebuildFailed) as e:
            self.ladder.refused(move, str(e), True)
            raise
