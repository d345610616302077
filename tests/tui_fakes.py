"""What the `ft top` tests feed the dashboard instead of a server: fixed state payloads (a
Qwen3-Next-sized cache, a rebuild history, a request list), feeds, a fake admin client and a clock
that moves only when told. No Textual widgets here, no torch."""

from __future__ import annotations

import asyncio
import math

from ft.schemas import CacheState, Event, History, LiveRates, PlanStep, RequestList, ResizePlan
from ft.tui.app import make_app
from ft.tui.source import Status, Update
from ft.tui.state import check_targets, pools_of, unit_bytes

GiB = 1024**3

CACHE = {
    "state": "serving", "model": "Qwen3-Next-80B-A3B-NVFP4", "budget_bytes": int(4.8 * GiB),
    "allocated_bytes": int(4.1 * GiB), "context_limit": 262144,
    "pools": {
        "moe": {"size": 512, "bytes": int(1.3 * GiB), "min": 64, "max": 1843, "policy": "lru", "backend": "offload",
                "total_experts": 24576, "resident": 498, "hit_rate": 0.912, "hits": 91200, "misses": 8800},
        "kv": {"size": 98304, "bytes": int(1.9 * GiB), "min": 4096, "max": 262144, "page_size": 64, "pages": 1536,
               "used": 611},
        "mamba": {"size": 8, "bytes": int(0.9 * GiB), "min": 4, "max": 44, "used": 3},
    },
    "ladder": {"enabled": True, "auto": True, "rungs": [65536 + 32768 * i for i in range(7)], "current": 1,
               "step": 32768, "last_decision": "grow to 98304: request 7 needs 81920 tokens (prompt 61440 + max 20480)"},
    "running": 3, "waiting": 1, "uptime_s": 7384.0, "started_at": 1_759_992_616.0,
    "device": {"card_bytes": 8 * GiB, "used_bytes": int(7.2 * GiB), "allocator_peak_bytes": int(2.1 * GiB),
               "headroom_bytes": int(0.7 * GiB)},
}
REQUESTS = {"running": 3, "waiting": 1, "uptime_s": 7384.0, "started_at": 1_759_992_616.0, "requests": [
    {"id": "chatcmpl-7f3a9c1e2b4d", "state": "decode", "prompt_tokens": 61440, "generated_tokens": 1893,
     "kv_pages": 990, "age_s": 84.2},
    {"id": "cmpl-2e81d07a5c93", "state": "decode", "prompt_tokens": 512, "generated_tokens": 77, "kv_pages": 10,
     "age_s": 3.4},
    {"id": "chatcmpl-0b9e4f6a8d21", "state": "prefill", "prompt_tokens": 30210, "generated_tokens": 0,
     "kv_pages": 256, "age_s": 0.6},
    {"id": "chatcmpl-c4d2a17e9f05", "state": "waiting", "prompt_tokens": 2048, "generated_tokens": 0,
     "kv_pages": 0, "age_s": 0.2},
]}
T0 = 1_760_000_000.0
HISTORY = {"entries": [
    {"id": 0, "time": T0, "trigger": "startup", "from": {}, "to": {"moe": 400, "kv": 65536, "mamba": 8},
     "peak_bytes": int(4.0 * GiB), "status": "ok", "phases": {"allocate_s": 1.2, "fill_s": 7.5, "total_s": 9.1}},
    {"id": 1, "time": T0 + 300, "trigger": "manual", "from": {"moe": 400, "kv": 65536, "mamba": 8},
     "to": {"moe": 1024, "kv": 65536, "mamba": 8}, "peak_bytes": int(4.6 * GiB), "status": "rolled_back",
     "error": "OutOfMemoryError('CUDA out of memory. Tried to allocate 800.00 MiB')",
     "phases": {"quiesce_s": 0.1, "free_s": 0.2, "allocate_s": 2.0, "total_s": 2.3}},
    {"id": 2, "time": T0 + 420, "trigger": "ladder", "reason": "grow to 98304: request 7 needs 81920 tokens",
     "from": {"moe": 624, "kv": 65536, "mamba": 8}, "to": {"moe": 512, "kv": 98304, "mamba": 8},
     "peak_bytes": int(4.1 * GiB), "measured_peak_bytes": int(4.05 * GiB), "status": "ok",
     "phases": {"quiesce_s": 0.05, "free_s": 0.11, "allocate_s": 0.31, "fill_s": 0.42, "graphs_s": 0.2,
                "total_s": 1.09}},
]}


def _rates(i: int) -> LiveRates:
    return LiveRates(decode_tokens_per_s=60 + 35 * math.sin(i / 5), expert_hit_rate=0.85 + 0.1 * math.sin(i / 9),
                     kv_usage=min(1.0, 0.2 + i / 150), engine_busy=0.6 + 0.3 * math.sin(i / 7))


class FixedSource:
    """Feeds the app a fixed sequence, synchronously, then waits for ever."""

    def __init__(self, updates=(), status: Status | None = None):
        self.updates, self.status = list(updates), status

    async def run(self, on_update, on_status) -> None:
        if self.status is not None:
            on_status(self.status)
        for u in self.updates:
            on_update(u)
        await asyncio.Event().wait()


class FakeClient:
    """cache/history/requests answer the fixed payloads; a dry run plans from the unit costs; a real
    resize or ladder move fails the test (the snapshots never act)."""

    def __init__(self):
        self.state = CacheState.model_validate(CACHE)

    def cache(self):
        return self.state

    def history(self):
        return History.model_validate(HISTORY)

    def requests(self):
        return RequestList.model_validate(REQUESTS)

    def resize(self, moe=None, kv=None, mamba=None, wait_s=None, dry_run=False):
        assert dry_run, "the snapshot tests never resize"
        targets = {k: v for k, v in {"moe": moe, "kv": kv, "mamba": mamba}.items() if v is not None}
        pools, total, steps = pools_of(self.state), self.state.allocated_bytes, []
        for name, t in sorted(targets.items(), key=lambda kv_: kv_[1] - pools[kv_[0]].size):
            delta = int((t - pools[name].size) * unit_bytes(pools[name]))
            total += delta
            steps.append(PlanStep(action=f"{'grow' if delta > 0 else 'shrink'} {name}", pool=name,
                                  delta_bytes=delta, total_bytes=total))
        problems = check_targets(self.state, targets)
        full = {k: targets.get(k, p.size) for k, p in pools.items()}
        return ResizePlan(target=full, steps=steps, peak_bytes=max([s.total_bytes for s in steps] or [total]),
                          budget_bytes=self.state.budget_bytes, fits=not problems, reason="; ".join(problems) or None)

    def ladder(self, auto=None, rung=None):
        raise AssertionError("the snapshot tests never move the ladder")


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def serving_updates(n: int = 90) -> list[Update]:
    """`n` events one second apart (uptime counts up), the history and request list on the first."""
    history, requests = History.model_validate(HISTORY), RequestList.model_validate(REQUESTS)
    out = []
    for i in range(n):
        cache = CacheState.model_validate({**CACHE, "uptime_s": CACHE["uptime_s"] - n + 1 + i})
        out.append(Update(Event(kind="snapshot" if i == 0 else "tick", cache=cache, rates=_rates(i)),
                          history if i == 0 else None, requests if i == 0 else None))
    return out


class SteppingSource(FixedSource):
    """FixedSource, with the clock moving one second before each update."""

    def __init__(self, updates, status, clock: Clock):
        super().__init__(updates, status)
        self.clock = clock

    async def run(self, on_update, on_status) -> None:
        on_status(self.status)
        for u in self.updates:
            self.clock.t += 1.0
            on_update(u)
        await asyncio.Event().wait()


def serving_app(clock: Clock | None = None, status: Status | None = None):
    clock = clock or Clock()
    return make_app("http://127.0.0.1:30000", None, 1.0, client=FakeClient(), clock=clock,
                    source=SteppingSource(serving_updates(), status or Status(True, "fixed"), clock))
