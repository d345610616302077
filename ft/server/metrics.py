"""/metrics in Prometheus format: the figures a user graphs.

Engine-side figures (pool sizes, expert hits, token counters, preemptions, rebuilds) are read from a
snapshot taken on the engine thread at scrape time; per-request figures (latencies, lengths) are
observed on the asyncio side when a request ends, the engine-side ones from the timestamps its
`Sequence` carries (`arrived_at`, `scheduled_at`, `first_token_at`, `finished_at`).

Every `ft_` series has a `model_name` label: the served model name (what /v1/models lists), so that
dashboards built for several servers can tell them apart. The series (counters get `_total`,
histograms `_bucket`/`_sum`/`_count` in the exposition):

    ft_build_info{version, git_rev}                    gauge, always 1
    ft_requests_running, ft_requests_waiting           gauges, requests
    ft_kv_tokens_used, ft_kv_tokens_capacity           gauges, tokens
    ft_kv_cache_usage_ratio                            gauge, 0..1 (used / capacity)
    ft_mamba_slots_used, ft_expert_slots               gauges, slots
    ft_cache_budget_bytes, ft_pool_bytes{pool}         gauges, bytes
    ft_expert_cache_hits, ft_expert_cache_misses       counters, expert lookups
    ft_expert_host_bytes                               counter, bytes moved host -> device
    ft_expert_landed                                   counter, experts
    ft_expert_prefill_streamed_bytes                   counter, bytes streamed into staging by prefill
    ft_expert_prefill_streamed                         counter, experts streamed by prefill
    ft_prompt_tokens, ft_generation_tokens             counters, tokens
    ft_prefix_cache_queried_tokens, ft_prefix_cache_hit_tokens   counters, tokens
    ft_prefix_cache_entries                            gauge, cached prefixes
    ft_prefix_cache_host_bytes                         gauge, bytes of their states in host memory
    ft_num_preemptions                                 counter, preemptions
    ft_rebuilds{status}                                counter, rebuilds
    ft_rebuild_duration_seconds{trigger}               histogram, seconds (rebuilds that resized)
    ft_requests_finished{finish_reason}                counter, requests
    ft_time_to_first_token_seconds, ft_inter_token_latency_seconds, ft_e2e_request_latency_seconds,
    ft_request_queue_time_seconds, ft_request_prefill_time_seconds, ft_request_decode_time_seconds
                                                       histograms, seconds
    ft_request_prompt_tokens, ft_request_generation_tokens       histograms, tokens per request
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

if TYPE_CHECKING:
    from ft.engine.core.stats import EngineStats

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
"""Seconds, for TTFT and inter-token latency."""

REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0,
                   1200.0)
"""Seconds, for whole-request spans (end to end, queue, prefill, decode)."""

REBUILD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Seconds, for cache rebuilds."""

LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))[:-2]
"""Tokens per request: 1, 2, 5, 10, ... 1,000,000."""

FINISH_REASONS = ("stop", "length", "abort", "cancelled", "error")
"""finish_reason label values: stop and length as in the API; abort: ended by the server (shutdown
drain); cancelled: the client went away; error: the request failed (an engine step, an unservable
request). Created at zero, so that a rate of errors is 0 rather than missing."""


class _EngineCollector:
    """The engine's figures, from the `EngineStats` `Metrics.render` was given (nothing when None:
    the engine is not serving)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot: EngineStats | None = None

    def _family(self, kind, name: str, doc: str, value=None, labels: tuple[str, ...] = ()):
        fam = kind(name, doc, labels=["model_name", *labels])
        if value is not None:
            fam.add_metric([self.model_name], value)
        return fam

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        m = self.model_name
        g = lambda name, doc, value: self._family(GaugeMetricFamily, name, doc, value)
        yield g("ft_requests_running", "Requests being prefilled or decoded", s.running)
        yield g("ft_requests_waiting", "Requests waiting for admission", s.waiting)
        yield g("ft_kv_tokens_used", "KV cache tokens held (requests and prefix cache)", s.kv_used_tokens)
        yield g("ft_kv_tokens_capacity", "KV cache capacity in tokens", s.kv_tokens)
        yield g("ft_kv_cache_usage_ratio", "KV cache tokens held / capacity, 0..1 (pages the prefix cache holds "
                "count as used)", s.kv_used_tokens / s.kv_tokens if s.kv_tokens else 0.0)
        yield g("ft_mamba_slots_used", "Linear-attention state slots in use", s.mamba_used)
        yield g("ft_expert_slots", "Expert cache slots on the device", s.moe_slots)
        yield g("ft_cache_budget_bytes", "Memory budget of the cache pools", s.budget_bytes)
        if s.device_memory is not None:  # (a CUDA device: `ft.memory.device_memory`)
            d = s.device_memory
            yield g("ft_device_memory_card_bytes", "The card the budget sees (the device, or --gpu-memory-limit)",
                    d["card_bytes"])
            yield g("ft_device_memory_used_bytes", "The device's memory in use by the driver's count, as nvidia-smi "
                    "shows it (weights, pools, reserves, allocator blocks, library workspaces, the CUDA context)",
                    d["used_bytes"])
            yield g("ft_device_memory_allocator_peak_bytes", "The most torch's caching allocator has held since the "
                    "server started", d["allocator_peak_bytes"])
            yield g("ft_device_memory_headroom_bytes", "Memory the budget keeps back from the pools and the "
                    "activation reserve (the headroom: --memory-ratio's share, or the default's)", d["headroom_bytes"])
        pools = self._family(GaugeMetricFamily, "ft_pool_bytes", "Bytes of each cache pool", labels=("pool",))
        for pool in ("moe", "kv", "mamba"):
            pools.add_metric([m, pool], getattr(s, f"{pool}_bytes"))
        yield pools
        c = lambda name, doc, value: self._family(CounterMetricFamily, name, doc, value)
        yield c("ft_expert_cache_hits", "Expert lookups served by a resident slot", s.hits)
        yield c("ft_expert_cache_misses", "Expert lookups that loaded from the host store", s.misses)
        yield c("ft_expert_host_bytes", "Expert bytes moved from host memory to the device (loads and in-place "
                "reads)", s.host_bytes)
        yield c("ft_expert_landed", "Experts cached by read-through landings during decode", s.landed)
        yield c("ft_expert_prefill_streamed_bytes", "Expert bytes offloaded prefill chunks streamed from host memory "
                "into staging pages (not cached, not in the hit counts)", s.streamed_bytes)
        yield c("ft_expert_prefill_streamed", "Experts offloaded prefill chunks streamed into staging pages",
                s.streamed_experts)
        yield c("ft_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)", s.prompt_tokens)
        yield c("ft_generation_tokens", "Tokens generated", s.generation_tokens)
        yield c("ft_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache at admission",
                s.prefix_queried_tokens)
        yield c("ft_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache at admission (not computed)",
                s.prefix_hit_tokens)
        yield g("ft_prefix_cache_entries", "Cached prefixes (KV pages and the linear-attention state after them)",
                s.prefix_entries)
        yield g("ft_prefix_cache_host_bytes", "Host memory the cached prefixes' linear-attention states take "
                "(--prefix-states-on-host; 0 when they hold device slots)", s.prefix_host_bytes)
        yield c("ft_num_preemptions", "Requests preempted (their KV freed, recomputed later) for lack of KV pages",
                s.preemptions)
        yield c("ft_decode_steps_overlapped", "Decode steps queued behind the step in flight before the host read "
                "its tokens (overlapped decode, --overlap-decode)", s.overlapped_steps)
        yield c("ft_ngram_table_rows_read", "N-gram table rows the host read from the checkpoint's files for steps "
                "(--ngram-table disk; 0 with the table in host memory)", s.ngram_rows_read)
        yield c("ft_ngram_table_read_seconds", "Seconds the engine thread spent reading those rows (a step's inputs "
                "wait on them; reads ahead of a prompt's next chunk count where a step waits for one)",
                s.ngram_read_seconds)
        for name, doc, values in (
                ("ft_engine_steps", "Engine steps by kind (decode: every row decodes a token; prefill: prompt chunks "
                 "only; mixed: a prompt chunk beside decoding rows)", s.steps),
                ("ft_engine_step_seconds", "Wall time the engine thread spent in steps, by kind (with overlapped "
                 "decode a decode step's time is the wait for the step queued before it)", s.step_seconds),
                ("ft_engine_slow_steps", "Steps far slower than their kind's usual, each logged with its rows and what "
                 "was paid for during it (a compile, a graph capture, new device memory, a rebuild)", s.slow_steps)):
            fam = self._family(CounterMetricFamily, name, doc, labels=("kind",))
            for kind, value in values.items():
                fam.add_metric([m, kind], value)
            yield fam
        for name, doc, key in (("ft_cuda_graph_replays", "Steps replayed from CUDA graphs, by kind (decode: a batch-size "
                                "bucket's graph; prefill: a short prompt's graphs around its attention cores)",
                                "graph_replays"),
                               ("ft_cuda_graph_captures", "CUDA graphs captured (a bucket's first step, again after "
                                "the addresses they read changed), by kind", "graph_captures")):
            fam = self._family(CounterMetricFamily, name, doc, labels=("kind",))
            for kind in ("decode", "prefill"):
                fam.add_metric([m, kind], getattr(s, key)[kind])
            yield fam
        rebuilds = self._family(CounterMetricFamily, "ft_rebuilds", "Cache rebuilds by status", labels=("status",))
        for status, n in s.rebuilds.items():
            rebuilds.add_metric([m, status], n)
        yield rebuilds
        yield from self._rebuild_durations(s.rebuild_durations)

    def _rebuild_durations(self, durations: list[tuple[str, float]]):
        """ft_rebuild_duration_seconds{trigger}, built from the whole history at each scrape."""
        fam = self._family(HistogramMetricFamily, "ft_rebuild_duration_seconds",
                           "Duration of the cache rebuilds that resized the pools, by trigger",
                           labels=("trigger",))
        by_trigger: dict[str, list[float]] = {}
        for trigger, seconds in durations:
            by_trigger.setdefault(trigger, []).append(seconds)
        for trigger, values in sorted(by_trigger.items()):
            buckets = [(str(b), sum(v <= b for v in values)) for b in REBUILD_BUCKETS]
            buckets.append(("+Inf", len(values)))
            fam.add_metric([self.model_name, trigger], buckets, sum(values))
        yield fam


class Metrics:
    """The server's Prometheus registry; `model_name` labels every series."""

    def __init__(self, model_name: str = "", build: dict | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        r, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        build = build or {}
        info = Gauge("ft_build_info", "Build of the running server (always 1; the labels carry it)",
                     [*m, "version", "git_rev"], registry=r)
        info.labels(model_name, str(build.get("version", "")), str(build.get("git_rev") or "")).set(1)
        self.ttft = hist("ft_time_to_first_token_seconds", "Time from request to first token", LATENCY_BUCKETS)
        self.itl = hist("ft_inter_token_latency_seconds", "Time between two tokens of a request", LATENCY_BUCKETS)
        self.e2e = hist("ft_e2e_request_latency_seconds", "Time from request (after tokenization) to its end, "
                        "whatever the finish reason", REQUEST_BUCKETS)
        self.queue = hist("ft_request_queue_time_seconds", "Time from queued in the engine to first scheduled",
                          REQUEST_BUCKETS)
        self.prefill = hist("ft_request_prefill_time_seconds", "Time from first scheduled to the first token",
                            REQUEST_BUCKETS)
        self.decode = hist("ft_request_decode_time_seconds", "Time from the first token to the request's end",
                           REQUEST_BUCKETS)
        self.prompt_len = hist("ft_request_prompt_tokens", "Prompt length of each request, tokens", LENGTH_BUCKETS)
        self.gen_len = hist("ft_request_generation_tokens", "Tokens generated by each request", LENGTH_BUCKETS)
        self.finished = Counter("ft_requests_finished", "Requests finished, by finish reason",
                                [*m, "finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(model_name, reason)

    def request_started(self) -> None:
        pass

    def on_token(self, gen, now: float) -> None:
        """A token of `gen` arrived at `now` (time.perf_counter seconds, gen's clock)."""
        if gen.token_times:
            self.itl.observe(now - gen.token_times[-1])
        elif gen.started_at is not None:
            self.ttft.observe(now - gen.started_at)

    def request_finished(self, gen, seq=None) -> None:
        """`gen` (a `Generation`) ended: count it by finish reason and observe its
        spans and lengths. `seq` is its engine `Sequence`, read for the engine-side spans (queue,
        prefill, decode); a span whose ends the engine has not stamped (a request cancelled before
        it ran, an abort the engine thread has not reached yet) is not observed.

        No finish reason means that no event of the request was read: the client went away first
        (a stream closed after its opening chunk), so it counts as "cancelled" (server-side ends,
        "abort" and "error", always set one)."""
        self.finished.labels(self.model_name, gen.finish_reason or "cancelled").inc()
        if gen.started_at is not None:
            self.e2e.observe(max(0.0, time.perf_counter() - gen.started_at))
        self.prompt_len.observe(gen.prompt_tokens)
        self.gen_len.observe(gen.completion_tokens)
        if seq is None:
            return
        arrived, scheduled = getattr(seq, "arrived_at", None), getattr(seq, "scheduled_at", None)
        first, finished = getattr(seq, "first_token_at", None), getattr(seq, "finished_at", None)
        for hist, start, end in ((self.queue, arrived, scheduled), (self.prefill, scheduled, first),
                                 (self.decode, first, finished)):
            if start is not None and end is not None:
                hist.observe(max(0.0, end - start))

    def render(self, snapshot: EngineStats | None) -> bytes:
        """The exposition text; `snapshot`: the engine's figures as the engine loop last published them
        (None: no engine series)."""
        self.engine.snapshot = snapshot
        return generate_latest(self.registry)
