"""The engine's admin interface: named commands (`EngineAdmin`) that `ft serve`'s admin routes run
on the engine thread, and the payloads they return, built with the shared schemas (`ft.schemas`).

The server names a command and passes plain data (`EngineLoop.command("resize", moe, kv, mamba)`);
it never hands the engine thread a function that reaches into the engine. A command's result is
plain data or a schema, so the same names could travel over a socket to an engine in its own
process. The functions below the class take the engine itself (the class and tests use them)."""

from __future__ import annotations

import time

from ft.schemas import (CacheState, History, HistoryEntry, LadderState, PlanStep, RequestInfo, RequestList,
                        ResizePlan)


def cache_state(engine, state: str, model_name: str) -> CacheState:
    pools = engine.pools
    g, lay = engine.cache.geometry, engine.cache.layout
    ranges = engine.cache.reachable_ranges()
    experts = pools.experts
    st = experts.stats if experts else None
    return CacheState.model_validate({
        "state": state,
        "model": model_name,
        "budget_bytes": engine.cache.budget.budget_bytes,
        "allocated_bytes": engine.cache.allocated_bytes,
        "context_limit": engine.context_limit,
        "running": len(engine.scheduler.running),
        "waiting": len(engine.waiting_requests()),
        "admission": "paused" if engine.scheduler.admission_paused else "open",
        **stamp(engine),
        "pools": {
            "moe": {
                "size": g.moe_slots, "bytes": lay.pool_bytes("moe", g.moe_slots), "min": ranges["moe"][0],
                "max": ranges["moe"][1], "policy": experts.policy if experts else "none",
                "backend": engine.config.moe_backend, "total_experts": engine.cache.total_experts,
                "resident": experts.num_resident if experts else 0, "hit_rate": st.hit_rate if st else 0.0,
                "hits": st.hits if st else 0, "misses": st.misses if st else 0,
                "read_through": bool(experts and experts.read_through),
                "landed": experts.read_through.landed_total if experts and experts.read_through else 0,
                "host_bytes": st.bytes_loaded if st else 0,
                "lent_bytes": engine.cache.lent, "loan_bytes": engine.cache.loan_bytes,
            },
            "kv": {
                "size": g.kv_tokens, "bytes": lay.pool_bytes("kv", g.kv_tokens), "min": ranges["kv"][0], "max": ranges["kv"][1],
                "page_size": pools.kv.page_size, "pages": pools.kv.num_pages, "used": pools.kv.num_used_pages,
                "cached": engine.prefix_cache.cached_only_pages(), "dtype": pools.kv.dtype_name,
            },
            "mamba": {
                "size": g.mamba_slots, "bytes": lay.pool_bytes("mamba", g.mamba_slots), "min": ranges["mamba"][0],
                "max": ranges["mamba"][1], "used": pools.mamba.num_used,
                "host_states": len(engine.prefix_cache) - engine.prefix_cache.num_slots,
                "host_bytes": engine.prefix_cache.host_bytes,
                "on_demand_max": engine.scheduler.max_running if engine.mamba_demand is not None else 0,
            },
        },
        "ladder": ladder_state(engine).model_dump(),
        "storage": engine.cache.describe()["storage"],
        "host_table_bytes": engine.model.host_bytes,
        "host_tables": dict(engine.model.host_tables),
        "disk_tables": dict(getattr(engine.model, "disk_tables", {})),
        "host_memory": {"parts": dict(engine.host_plan.parts),
                        "available_bytes": engine.host_plan.available[0] if engine.host_plan.available else None,
                        "available_from": engine.host_plan.available[1] if engine.host_plan.available else ""},
        "device": engine.device_memory.figures() or {},  # (zeros on the CPU)
        "degraded": engine.cache.degraded,
        "exchange": exchange(engine),
        "ranks": rank_caches(engine),
    })


def rank_caches(engine) -> list[dict]:
    """Each GPU's budget, pools and expert counters under tensor parallelism, asked of every rank
    now (a control message: this runs on the engine thread); empty on one GPU."""
    peers = engine.cache.peers
    if peers is None:
        return []
    if engine.pools.experts is not None:
        engine.pools.experts.collect()  # NOTE: the last decode step's counters, as every worker does (rank_report)
    st = engine.pools.experts.stats if engine.pools.experts is not None else None
    mine = {**engine.cache.describe(),
            "experts": {"hits": st.hits, "misses": st.misses} if st else None}
    out = []
    for rank, d in enumerate([mine, *peers.describe()]):
        g, ex = d["geometry"], d.get("experts") or {}
        out.append({"rank": rank, "budget_bytes": d["budget"]["budget_bytes"], "held_bytes": d["storage"]["held_bytes"],
                    "moe_slots": g["moe_slots"], "kv_tokens": g["kv_tokens"], "mamba_slots": g["mamba_slots"],
                    "hits": ex.get("hits", 0), "misses": ex.get("misses", 0)})
    return out


def stamp(engine) -> dict:
    """When an answer was computed: uptime on the monotonic clock (it never goes backwards, so a
    client can drop an answer older than one it has shown) and the process's start, which tells a
    restart apart."""
    mono = getattr(engine, "started_monotonic", None)
    uptime = time.monotonic() - mono if mono is not None else time.time() - engine.started_at
    return {"uptime_s": round(uptime, 3), "started_at": round(engine.started_at, 3)}


def running_state(seq) -> str:
    """A running request's phase: prefill until its first token is out (or while it recomputes
    after a preemption), then decode."""
    return "prefill" if not seq.output_ids or seq.num_uncomputed > 1 else "decode"


def requests(engine, limit: int = 200) -> RequestList:
    """The running requests in batch order, then the waiting ones (queued, or preempted and queued
    again) in queue order, `limit` at most."""
    sched = engine.scheduler
    running, waiting = list(sched.running), engine.waiting_requests()
    now = time.time()
    rows = [(seq, running_state(seq)) for seq in running] + [(seq, "waiting") for seq in waiting]
    return RequestList(
        requests=[RequestInfo(id=seq.request_id, state=state, prompt_tokens=len(seq.prompt_ids),
                              generated_tokens=len(seq.output_ids), kv_pages=len(seq.pages),
                              age_s=round(max(0.0, now - seq.queued_at), 3)) for seq, state in rows[:limit]],
        running=len(running), waiting=len(waiting), truncated=len(rows) > limit, **stamp(engine))


def exchange(engine) -> dict:
    """One expert slot in KV tokens and in mamba slots (measured unit costs)."""
    c = engine.cache.layout.unit_costs()
    per_token = c.kv_page / c.page_size
    return {"kv_tokens_per_expert_slot": c.expert_slot / per_token if per_token else 0.0,
            "mamba_slots_per_expert_slot": c.expert_slot / c.mamba_slot if c.mamba_slot else 0.0}


def rounding_notes(engine, kv: int | None) -> list[str]:
    """A KV target that is not whole pages is rounded up: say so, never silently."""
    if kv is None:
        return []
    rounded = engine.cache.layout.round_size("kv", kv)
    if rounded == kv:
        return []
    page = engine.pools.kv.page_size
    return [f"kv {kv} rounded up to {rounded} tokens (whole pages of {page})"]


def ladder_state(engine) -> LadderState:
    lad = engine.ladder
    if lad is None:
        return LadderState()
    return LadderState(enabled=True, auto=lad.auto, rungs=list(lad.rungs), current=lad.current(engine.cache.geometry.kv_tokens),
                       step=lad.opts.step, last_decision=lad.last_decision)


def resize_plan(p, notes: list[str] | None = None, ranges: dict | None = None) -> ResizePlan:
    return ResizePlan(notes=notes or [], ranges={k: list(v) for k, v in (ranges or {}).items()},
        target=p.target.sizes(),
        steps=[PlanStep(action=f"{s.action} {s.pool}", pool=s.pool, delta_bytes=s.delta_bytes, total_bytes=s.total_bytes,
                        peak_bytes=s.peak_bytes) for s in p.steps],
        peak_bytes=p.peak_bytes, budget_bytes=p.budget_bytes, fits=p.fits, reason=p.reason,
    )


def history(engine) -> History:
    return History(entries=[HistoryEntry.model_validate(h) for h in reversed(engine.cache.history)])


class EngineAdmin:
    """The commands of `ft serve`'s admin routes, by name (`COMMANDS`), over one engine. Each runs on
    the engine thread (between two steps) and returns plain data or a schema. Contract: `resize`
    and `set_ladder` raise the cache's RebuildRefused (nothing touched) or RebuildFailed (rolled back)."""

    COMMANDS = frozenset({"cache_state", "resize_plan", "resize", "fits_when_idle", "rounding_notes", "history",
                          "requests", "ladder_enabled", "mamba_on_demand", "set_ladder", "pause_admission"})

    def __init__(self, engine) -> None:
        self.engine = engine

    def cache_state(self, state: str, model_name: str) -> CacheState:
        """GET /admin/cache's answer, with `state` as the server sees it (serving, rebuilding)."""
        return cache_state(self.engine, state, model_name)

    def resize_plan(self, moe: int | None, kv: int | None, mamba: int | None) -> ResizePlan:
        """A dry run: the plan of a resize to these sizes (None: unchanged), notes and reachable ranges."""
        cache = self.engine.cache
        return resize_plan(cache.plan_resize(moe, kv, mamba), rounding_notes(self.engine, kv),
                           cache.ranges_around(moe, kv, mamba))

    def resize(self, moe: int | None, kv: int | None, mamba: int | None, model_name: str) -> CacheState:
        """Rebuild the pools to these sizes (a manual rebuild); the state after it."""
        self.engine.cache.rebuild(moe, kv, mamba, trigger="manual")
        return cache_state(self.engine, "serving", model_name)

    def fits_when_idle(self, moe: int | None, kv: int | None, mamba: int | None) -> bool:
        """Whether the target would fit once running requests released what they hold."""
        return self.engine.cache.plan_resize(moe, kv, mamba, held=False).fits

    def rounding_notes(self, kv: int | None) -> list[str]:
        return rounding_notes(self.engine, kv)

    def history(self) -> History:
        return history(self.engine)

    def requests(self, limit: int) -> RequestList:
        return requests(self.engine, limit)

    def ladder_enabled(self) -> bool:
        return self.engine.ladder is not None

    def mamba_on_demand(self) -> bool:
        """Whether the linear-attention pool sizes itself (--mamba-on-demand): no manual mamba size then."""
        return self.engine.mamba_demand is not None

    def set_ladder(self, auto: bool | None, rung: int | str | None, model_name: str) -> CacheState:
        """Auto on or off, and a manual rung move (an index, "up" or "down": a rebuild); the state after."""
        lad = self.engine.ladder
        if auto is not None:
            lad.auto = auto
            lad.last_decision = f"auto {'on' if auto else 'off'} (manual)"
        if rung is not None:
            self.engine.move_ladder(rung)
        return cache_state(self.engine, "serving", model_name)

    def pause_admission(self, paused: bool) -> None:
        """Hold (True) or resume (False) the admission of waiting requests (a rebuild drains)."""
        self.engine.pause_admission(paused)
