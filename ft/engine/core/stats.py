"""The engine's figures at one instant, as one immutable value (`EngineStats`).

The engine thread takes it (`engine_stats`, between two steps) and the server's engine loop
publishes it; `/metrics`, `GET /admin/events` and the stats line read the published value, so that
a scrape never waits for the engine (a long prefill, a rebuild) nor drains an overlapped step.
Plain numbers only: readers on other threads touch no engine object.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["EngineStats", "engine_stats"]


@dataclass(frozen=True)
class EngineStats:
    """Counters are totals since the engine started; the rest is the state when `at` was taken."""

    at: float  # time.monotonic() when taken
    running: int
    waiting: int
    kv_used_tokens: int  # pages held (requests and prefix cache) x page size
    kv_tokens: int
    mamba_used: int
    mamba_slots: int
    moe_slots: int
    budget_bytes: int
    moe_bytes: int
    kv_bytes: int
    mamba_bytes: int
    offloaded: bool  # an expert cache with host-store lookups (hits and misses count)
    hits: int
    misses: int
    host_bytes: int
    landed: int
    streamed_bytes: int  # expert bytes offloaded prefill chunks streamed into staging (not landed)
    streamed_experts: int
    prompt_tokens: int
    generation_tokens: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_entries: int  # cached prefixes
    prefix_host_bytes: int  # their linear-attention states in host memory (--prefix-states-on-host)
    preemptions: int
    overlapped_steps: int
    ngram_rows_read: int  # a paged n-gram table's rows the host read for steps (--ngram-table disk; 0 without one)
    ngram_read_seconds: float  # the engine thread's time in those reads
    steps: dict[str, int]  # by kind: decode, mixed, prefill (`ft.engine.core.step_times`)
    step_seconds: dict[str, float]  # the engine thread's wall time in them
    slow_steps: dict[str, int]  # of them, those far slower than their kind's usual (`ft.engine.core.slow_steps`)
    graph_replays: dict[str, int]  # by kind: decode, prefill
    graph_captures: dict[str, int]
    rebuilds: dict[str, int]  # by status (startup excluded)
    rebuild_durations: tuple[tuple[str, float], ...]  # (trigger, seconds) of each rebuild that ran
    rung: int | None  # the KV ladder's rung (0-based), None between rungs or without a ladder
    rungs: int  # 0: no ladder
    # the card by the driver's count (`ft.memory.device_memory`), None on the CPU: card_bytes, used_bytes,
    # allocator_peak_bytes, headroom_bytes
    device_memory: dict[str, int] | None = None


def engine_stats(engine: Any) -> EngineStats:
    """Take the figures (on the engine thread)."""
    pools = engine.pools
    experts = pools.experts
    st = experts.stats if experts is not None else None
    stream = experts.prefill_stream if experts is not None else None
    rebuilds: dict[str, int] = {}
    durations: list[tuple[str, float]] = []
    for h in engine.cache.history:
        if h["trigger"] == "startup":
            continue
        rebuilds[h["status"]] = rebuilds.get(h["status"], 0) + 1
        took = (h.get("phases") or {}).get("total_s")
        if took is not None and h["status"] != "refused":  # a refusal recorded by the ladder ran nothing
            durations.append((h["trigger"], float(took)))
    graphs = {"decode": engine.runner.graphs, "prefill": engine.runner.prefill_graphs}
    lad = engine.ladder
    reader = getattr(engine.model, "ngram_reader", None)  # (`ft.model.ngram_reader`: a paged n-gram table's)
    return EngineStats(
        at=time.monotonic(),
        running=len(engine.scheduler.running), waiting=len(engine.waiting_requests()),
        kv_used_tokens=pools.kv.num_used_pages * pools.kv.page_size, kv_tokens=pools.kv.num_tokens,
        mamba_used=pools.mamba.num_used, mamba_slots=engine.cache.geometry.mamba_slots, moe_slots=experts.num_slots if experts is not None else 0,
        budget_bytes=engine.cache.budget.budget_bytes, moe_bytes=experts.nbytes if experts is not None else 0,
        kv_bytes=pools.kv.nbytes, mamba_bytes=pools.mamba.nbytes,
        offloaded=st is not None, hits=st.hits if st else 0, misses=st.misses if st else 0,
        host_bytes=st.bytes_loaded if st else 0,
        landed=experts.read_through.landed_total if experts is not None and experts.read_through else 0,
        streamed_bytes=stream.stats.bytes if stream is not None else 0,
        streamed_experts=stream.stats.experts if stream is not None else 0,
        prompt_tokens=engine.counters["prompt_tokens"], generation_tokens=engine.counters["generation_tokens"],
        prefix_queried_tokens=engine.prefix_cache.query_tokens, prefix_hit_tokens=engine.prefix_cache.hit_tokens,
        prefix_entries=len(engine.prefix_cache), prefix_host_bytes=engine.prefix_cache.host_bytes,
        preemptions=engine.scheduler.num_preemptions, overlapped_steps=engine.overlapped_steps,
        ngram_rows_read=reader.rows_read if reader is not None else 0,
        ngram_read_seconds=reader.read_s if reader is not None else 0.0,
        steps=dict(engine.step_times.count), step_seconds=dict(engine.step_times.seconds),
        slow_steps=dict(engine.slow_steps.count),
        graph_replays={k: g.replays if g is not None else 0 for k, g in graphs.items()},
        graph_captures={k: g.captures if g is not None else 0 for k, g in graphs.items()},
        rebuilds=rebuilds, rebuild_durations=tuple(durations),
        rung=lad.current(engine.cache.geometry.kv_tokens) if lad is not None else None,
        rungs=len(lad.rungs) if lad is not None else 0,
        device_memory=engine.device_memory.figures(),  # (a cached reading between its interval's driver calls)
    )
