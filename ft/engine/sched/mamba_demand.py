"""Device linear-attention state slots on demand (`--mamba-on-demand`, `EngineConfig.mamba_on_demand`).

Offloaded, with the prefix cache's states in host memory, a device mamba slot serves one running request
and nothing else; yet the pool is sized for every request the server may run at once (8 by default:
882 MiB of Qwen3.8-Flash-Next's 110 MiB states on a 16 GiB card, ~330 expert slots) while one user
chatting holds one. With this on, the pool starts at `MAMBA_ON_DEMAND_MIN` slots and the expert slots
fill the rest of the budget. A request that finds no free slot grows the pool first, to the slots the
running and waiting requests need (at most `max_running_requests`): a live rebuild (trigger "mamba")
whose expert slots shrink to what the budget then leaves. Once at least one slot has stayed free for
`IDLE_S` seconds with nothing waiting, the pool shrinks to the running requests' slots (at least the
minimum) and the experts take the bytes back.

A grow that is refused or fails leaves the requests waiting while others run (they free slots as they
end) and is tried again once the geometry changed or `IDLE_S` passed; with nothing running the pool always
has a free slot. A
shrink that fails is tried again after `IDLE_S`. Each resize recalls the prefill reserve's loan first
(`CacheManager.rebuild`), which goes out again on its own. Not yet measured on a GPU.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ft.engine.cache.manager import CacheManager
from ft.engine.sched.scheduler import Scheduler
from ft.errors import RebuildFailed, RebuildRefused

log = logging.getLogger("ft.engine")

IDLE_S = 10.0
"""Seconds with a free slot (and nothing waiting) before the pool gives its idle slots back to the experts."""


class MambaOnDemand:
    """When the device mamba pool grows for waiting requests and when it shrinks back (the module docstring)."""

    def __init__(self, cache: CacheManager, scheduler: Scheduler, minimum: int, waiting: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`waiting`: the requests that want a slot and hold none (the scheduler's queue and the n-choice
        siblings that fork at their parent's first token: `Engine.waiting_requests`)."""
        self.cache, self.scheduler, self.minimum, self.clock = cache, scheduler, max(1, minimum), clock
        self.waiting = waiting
        self.full_at = clock()  # the last time every slot was in use (or the pool grew, or a shrink was tried)
        self._refused = None  # (geometry, time) of a grow refused or failed: not tried again at that geometry
        # for idle_s seconds
        self.idle_s = IDLE_S
        self.grows = self.shrinks = 0

    def _slots(self) -> tuple[int, int]:
        mamba = self.cache.pools.mamba
        return mamba.num_slots, mamba.num_free

    def before_admission(self) -> dict | None:
        """Before the scheduler admits: when waiting requests it could admit (n-choice siblings too, which
        fork at their parent's first token) find fewer free slots than they need, grow the pool to the
        running and waiting requests' count (at most max_running; fewer when the expert floor allows no
        more). Returns the rebuild's history entry (None: no grow)."""
        sched = self.scheduler
        if sched.admission_paused or sched.hold_head or len(sched.running) >= sched.max_running:
            return None
        wanting = self.waiting()
        if not wanting:
            return None
        slots, free = self._slots()
        admissible = min(wanting, sched.max_running - len(sched.running))
        if free >= admissible:
            return None
        g = self.cache.geometry
        if self._refused is not None and self._refused[0] == g and self.clock() - self._refused[1] < self.idle_s:
            return None
        want = slots + admissible - free
        target = next((m for m in range(want, slots, -1)
                       if self.cache.moe_beside(g.kv_tokens, mamba_slots=m) is not None), None)
        if target is None:
            self._refused = (g, self.clock())
            self.cache.record("mamba", f"{admissible} waiting request(s) need {admissible - free} more linear-"
                              f"attention slot(s)", "refused", f"one more slot would leave less than the expert "
                              f"floor {self.cache.expert_floor}")
            return None
        try:
            entry = self.cache.rebuild(moe=self.cache.moe_beside(g.kv_tokens, mamba_slots=target), mamba=target,
                                       trigger="mamba", reason=f"{admissible} waiting request(s) need "
                                       f"{admissible - free} more linear-attention slot(s)")
        except (RebuildRefused, RebuildFailed) as e:
            self._refused = (g, self.clock())
            log.warning("the linear-attention pool could not grow for waiting requests (%s); they wait for "
                        "running ones to end", e)
            return None
        self.grows += 1
        self.full_at = self.clock()
        return entry

    def due(self) -> bool:
        """Whether the pool should shrink now: a slot has stayed free for IDLE_S seconds, nothing waits,
        and the pool holds more than the running requests' slots (at least the minimum). Called every
        step (the overlapped decode asks it before queuing): it also notes when every slot is in use."""
        slots, free = self._slots()
        if free == 0:
            self.full_at = self.clock()
            return False
        keep = max(self.minimum, len(self.scheduler.running))
        return slots > keep and self.clock() - self.full_at >= self.idle_s and not self.waiting()

    def shrink(self, reason: str) -> dict | None:
        """Give the slots beyond the running requests' (at least the minimum) back to the experts; None
        when there are none. A failure is logged (rolled back: the pools as they were) and tried again
        after IDLE_S."""
        g = self.cache.geometry
        keep = max(self.minimum, len(self.scheduler.running))
        self.full_at = self.clock()
        if g.mamba_slots <= keep:
            return None
        moe = self.cache.moe_beside(g.kv_tokens, mamba_slots=keep)
        try:
            entry = self.cache.rebuild(moe=moe, mamba=keep, trigger="mamba", reason=reason)
        except (RebuildRefused, RebuildFailed) as e:
            log.warning("the linear-attention pool could not give its idle slots back (%s); tried again in %.0f s",
                        e, self.idle_s)
            return None
        self.shrinks += 1
        self._refused = None
        return entry

    def before_step(self) -> None:
        """At the top of a plain engine step: shrink when due."""
        if self.due():
            self.shrink(f"slots unused for {self.idle_s:.0f} s")
