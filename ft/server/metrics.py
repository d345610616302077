"""/metrics in Prometheus format: the figures a user graphs.

Engine-side figures (pool sizes, expert hits, token counters) are read from a snapshot taken on
the engine thread at scrape time; request latencies are observed on the asyncio side.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    def __init__(self) -> None:
        self.snapshot: dict = {}

    def collect(self):
        s = self.snapshot
        if not s:
            return
        g = lambda name, doc, value: GaugeMetricFamily(name, doc, value=value)  # noqa: E731
        yield g("ft_requests_running", "Requests being prefilled or decoded", s["running"])
        yield g("ft_requests_waiting", "Requests waiting for admission", s["waiting"])
        yield g("ft_kv_tokens_used", "KV cache tokens held (requests and prefix cache)", s["kv_used_tokens"])
        yield g("ft_kv_tokens_capacity", "KV cache capacity in tokens", s["kv_tokens"])
        yield g("ft_mamba_slots_used", "Linear-attention state slots in use", s["mamba_used"])
        yield g("ft_expert_slots", "Expert cache slots on the device", s["moe_slots"])
        yield g("ft_cache_budget_bytes", "Memory budget of the cache pools", s["budget_bytes"])
        pools = GaugeMetricFamily("ft_pool_bytes", "Bytes of each cache pool", labels=["pool"])
        for pool in ("moe", "kv", "mamba"):
            pools.add_metric([pool], s[f"{pool}_bytes"])
        yield pools
        c = lambda name, doc, value: CounterMetricFamily(name, doc, value=value)  # noqa: E731
        yield c("ft_expert_cache_hits", "Expert lookups served by a resident slot", s["hits"])
        yield c("ft_expert_cache_misses", "Expert lookups that loaded from the host store", s["misses"])
        yield c("ft_expert_host_bytes", "Expert bytes read from host memory (loads and in-place reads)", s["host_bytes"])
        yield c("ft_expert_landed", "Experts cached by read-through landings during decode", s["landed"])
        yield c("ft_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)", s["prompt_tokens"])
        yield c("ft_generation_tokens", "Tokens generated", s["generation_tokens"])
        rebuilds = CounterMetricFamily("ft_rebuilds", "Cache rebuilds by status", labels=["status"])
        for status, n in s["rebuilds"].items():
            rebuilds.add_metric([status], n)
        yield rebuilds


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector()
        self.registry.register(self.engine)
        self.ttft = Histogram("ft_time_to_first_token_seconds", "Time from request to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("ft_inter_token_latency_seconds", "Time between two tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("ft_requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=self.registry)

    def request_started(self) -> None:
        pass

    def on_token(self, gen, now: float) -> None:
        if gen.token_times:
            self.itl.observe(now - gen.token_times[-1])
        elif gen.started_at is not None:
            self.ttft.observe(now - gen.started_at)

    def request_finished(self, gen) -> None:
        self.finished.labels(gen.finish_reason or "abort").inc()

    def render(self, snapshot: dict) -> bytes:
        self.engine.snapshot = snapshot
        return generate_latest(self.registry)


def engine_snapshot(engine) -> dict:
    """Figures for /metrics, read on the engine thread."""
    pools = engine.pools
    st = pools.experts.stats if pools.experts else None
    rebuilds: dict[str, int] = {}
    for h in engine.cache.history:
        if h["trigger"] != "startup":
            rebuilds[h["status"]] = rebuilds.get(h["status"], 0) + 1
    return {
        "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
        "kv_used_tokens": pools.kv.num_used_pages * pools.kv.page_size, "kv_tokens": pools.kv.num_tokens,
        "mamba_used": pools.mamba.num_used, "moe_slots": pools.experts.num_slots if pools.experts else 0,
        "budget_bytes": engine.cache.budget.budget_bytes,
        "moe_bytes": pools.experts.nbytes if pools.experts else 0, "kv_bytes": pools.kv.nbytes,
        "mamba_bytes": pools.mamba.nbytes, "hits": st.hits if st else 0, "misses": st.misses if st else 0,
        "host_bytes": st.bytes_loaded if st else 0,
        "landed": pools.experts.read_through.landed_total if pools.experts and pools.experts.read_through else 0,
        "prompt_tokens": engine.counters["prompt_tokens"], "generation_tokens": engine.counters["generation_tokens"],
        "rebuilds": rebuilds,
    }
