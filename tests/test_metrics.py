"""/metrics on the demo model, in process: every ft_ series carries model_name, the per-request
histograms observe what the requests did, engine counters (prefix cache, preemptions, rebuilds)
are exported, errors are counted apart from aborts, and the Grafana dashboard graphs only series
that /metrics exports."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
from inproc_server import AUTH, DEMO, complete, demo_app, samples, value
from server_proc import WAIT_S, wait_for

import ft
from ft.server.util_routes import build_info

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"

NEW_SERIES = (
    "ft_build_info", "ft_kv_cache_usage_ratio", "ft_prefix_cache_queried_tokens_total",
    "ft_prefix_cache_hit_tokens_total", "ft_num_preemptions_total",
    "ft_e2e_request_latency_seconds_bucket", "ft_request_queue_time_seconds_bucket",
    "ft_request_prefill_time_seconds_bucket", "ft_request_decode_time_seconds_bucket",
    "ft_request_prompt_tokens_bucket", "ft_request_generation_tokens_bucket",
    "ft_cuda_graph_replays_total", "ft_cuda_graph_captures_total", "ft_decode_steps_overlapped_total",
    "ft_engine_steps_total", "ft_engine_step_seconds_total", "ft_ngram_table_rows_read_total",
    "ft_ngram_table_read_seconds_total", "ft_engine_slow_steps_total",
)
OLD_SERIES = (
    "ft_requests_running", "ft_requests_waiting", "ft_kv_tokens_used", "ft_kv_tokens_capacity", "ft_mamba_slots_used",
    "ft_expert_slots", "ft_cache_budget_bytes", "ft_pool_bytes", "ft_expert_cache_hits_total",
    "ft_expert_cache_misses_total", "ft_expert_host_bytes_total", "ft_expert_landed_total", "ft_prompt_tokens_total",
    "ft_generation_tokens_total", "ft_time_to_first_token_seconds_bucket", "ft_inter_token_latency_seconds_bucket",
    "ft_requests_finished_total",
)
SPANS = ("ft_request_queue_time_seconds", "ft_request_prefill_time_seconds", "ft_request_decode_time_seconds")


@pytest.fixture(scope="module")
def app():
    with demo_app() as (client, state):
        yield client, state


def test_cuda_graph_series_by_kind(app):
    """Replays and captures of the decode and prefill CUDA graphs, one series per kind (zero on the
    CPU, where no graph runs)."""
    client, _ = app
    got = {(s.name, s.labels.get("kind")): s.value for s in samples(client)
           if s.name in ("ft_cuda_graph_replays_total", "ft_cuda_graph_captures_total")}
    assert got == {(n, k): 0.0 for n in ("ft_cuda_graph_replays_total", "ft_cuda_graph_captures_total")
                   for k in ("decode", "prefill")}


def finished(client) -> dict[str, float]:
    return {s.labels["finish_reason"]: s.value for s in samples(client) if s.name == "ft_requests_finished_total"}


def test_every_series_has_model_name_and_the_new_ones_exist(app):
    client, _ = app
    assert complete(client, "metrics please", 3).status_code == 200
    r = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": DEMO, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    got = samples(client)
    ft_samples = [s for s in got if s.name.startswith("ft_")]
    assert ft_samples and all(s.labels.get("model_name") == DEMO for s in ft_samples), \
        [s for s in ft_samples if s.labels.get("model_name") != DEMO][:3]
    names = {s.name for s in ft_samples}
    for name in NEW_SERIES + OLD_SERIES:
        assert name in names, name
    pools = {s.labels["pool"] for s in ft_samples if s.name == "ft_pool_bytes"}
    assert pools == {"moe", "kv", "mamba"}
    for name in ("ft_e2e_request_latency_seconds", "ft_request_prompt_tokens", "ft_request_generation_tokens",
                 *SPANS):
        assert value(client, name + "_count") >= 2, name


def test_build_info(app):
    client, _ = app
    info = [s for s in samples(client) if s.name == "ft_build_info"]
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["version"] == ft.__version__
    assert info[0].labels["git_rev"] == (build_info()["git_rev"] or "")


def test_request_histograms_observe_each_request(app):
    """One request moves each per-request histogram by one observation: its lengths exactly, its
    engine-side spans (queue, prefill, decode) within its end-to-end latency."""
    client, _ = app
    names = ("ft_e2e_request_latency_seconds", "ft_request_prompt_tokens", "ft_request_generation_tokens", *SPANS)
    before = {n: (value(client, n + "_count"), value(client, n + "_sum")) for n in names}
    r = complete(client, [5, 6, 7, 8, 9, 10, 11], 6)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    after = {n: (value(client, n + "_count"), value(client, n + "_sum")) for n in names}
    delta = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in names}
    assert all(d[0] == 1 for d in delta.values()), delta
    assert delta["ft_request_prompt_tokens"][1] == 7 and delta["ft_request_generation_tokens"][1] == 6
    spans = [delta[n][1] for n in SPANS]
    assert all(s >= 0 for s in spans) and delta["ft_request_decode_time_seconds"][1] > 0
    assert sum(spans) <= delta["ft_e2e_request_latency_seconds"][1] + 1e-3  # the engine's part of the request


def test_length_buckets_count_per_request(app):
    client, _ = app
    before = value(client, "ft_request_generation_tokens_bucket", le="5.0")
    before_inf = value(client, "ft_request_generation_tokens_bucket", le="+Inf")
    complete(client, "abc", 4)
    complete(client, "abc", 7)
    assert value(client, "ft_request_generation_tokens_bucket", le="5.0") - before == 1  # the 4, not the 7
    assert value(client, "ft_request_generation_tokens_bucket", le="+Inf") - before_inf == 2


def test_kv_usage_ratio_is_used_over_capacity(app):
    client, _ = app
    complete(client, "leaves its pages in the prefix cache", 2)
    got = {s.name: s.value for s in samples(client)}
    ratio = got["ft_kv_cache_usage_ratio"]
    assert 0 < ratio <= 1  # the prefix cache holds the earlier requests' pages
    assert ratio == pytest.approx(got["ft_kv_tokens_used"] / got["ft_kv_tokens_capacity"])


def test_prefix_cache_tokens(app):
    """A prompt whose first 80 tokens a finished request left in the prefix cache: 80 hit tokens,
    and both prompts' lengths queried."""
    client, _ = app
    prompt = [(7 * i) % 300 + 10 for i in range(80)]
    q0, h0 = value(client, "ft_prefix_cache_queried_tokens_total"), value(client, "ft_prefix_cache_hit_tokens_total")
    assert complete(client, prompt, 1).status_code == 200  # its 80 computed tokens go to the prefix cache
    assert value(client, "ft_prefix_cache_hit_tokens_total") == h0
    r = complete(client, prompt + [42, 43], 1)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    assert value(client, "ft_prefix_cache_hit_tokens_total") - h0 == 80
    assert value(client, "ft_prefix_cache_queried_tokens_total") - q0 == 80 + 82
    assert value(client, "ft_prefix_cache_entries") >= 1  # the entries' states in device slots on the CPU:
    assert value(client, "ft_prefix_cache_host_bytes") == 0  # nothing in host memory


def test_preemptions_are_the_schedulers_count(app):
    client, state = app
    before = value(client, "ft_num_preemptions_total")
    assert before == state.loop.call_sync(lambda e: e.scheduler.num_preemptions, timeout=WAIT_S)

    def preempted(e):  # what Scheduler._preempt counts
        e.scheduler.num_preemptions += 2

    state.loop.call_sync(preempted, timeout=WAIT_S)
    assert value(client, "ft_num_preemptions_total") - before == 2


def test_overlapped_decode_steps_are_the_engines_count(app):
    """Zero for the demo on the CPU (overlapped decode is off there by default), and what the engine
    counts."""
    client, state = app
    before = value(client, "ft_decode_steps_overlapped_total")
    assert before == state.loop.call_sync(lambda e: e.overlapped_steps, timeout=WAIT_S) == 0

    def overlapped(e):  # what OverlappedDecode.step counts
        e.overlap.steps += 3

    state.loop.call_sync(overlapped, timeout=WAIT_S)
    assert value(client, "ft_decode_steps_overlapped_total") - before == 3


def test_engine_steps_by_kind(app):
    """A request alone: its prompt in one prefill step (which gives its first token), each further token in a
    decode step, no mixed step; each kind's seconds move with its steps."""
    client, _ = app

    def split():
        return {(s.name, s.labels["kind"]): s.value for s in samples(client)
                if s.name in ("ft_engine_steps_total", "ft_engine_step_seconds_total")}

    before = split()
    assert set(before) == {(n, k) for n in ("ft_engine_steps_total", "ft_engine_step_seconds_total")
                           for k in ("decode", "mixed", "prefill")}
    assert complete(client, [(11 * i) % 290 + 7 for i in range(21)], 5).status_code == 200
    after = split()
    steps = {k: after[("ft_engine_steps_total", k)] - before[("ft_engine_steps_total", k)]
             for k in ("decode", "mixed", "prefill")}
    seconds = {k: after[("ft_engine_step_seconds_total", k)] - before[("ft_engine_step_seconds_total", k)]
               for k in ("decode", "mixed", "prefill")}
    assert steps == {"decode": 4, "mixed": 0, "prefill": 1}
    assert seconds["decode"] > 0 and seconds["prefill"] > 0 and seconds["mixed"] == 0


def test_rebuild_durations_and_counts(app):
    """A resize through the admin API: one more ok rebuild and one more duration observation
    (trigger manual); a refusal the ladder records is counted but has no duration."""
    client, state = app
    base = {s.name + repr(sorted(s.labels.items())): s.value for s in samples(client)}
    kv = state.loop.call_sync(lambda e: e.pools.kv.num_tokens, timeout=WAIT_S)
    r = client.post("/admin/cache", json={"kv": kv // 2, "wait_s": WAIT_S})
    assert r.status_code == 200, r.text
    state.loop.call_sync(lambda e: e.cache.record("ladder", "a test refusal", "refused", "no room"), timeout=WAIT_S)
    try:
        ok_before = base.get("ft_rebuilds_total" + repr(sorted({"model_name": DEMO, "status": "ok"}.items())), 0)
        assert value(client, "ft_rebuilds_total", status="ok") - ok_before == 1
        refused_before = base.get(
            "ft_rebuilds_total" + repr(sorted({"model_name": DEMO, "status": "refused"}.items())), 0)
        assert value(client, "ft_rebuilds_total", status="refused") - refused_before == 1
        count_key = "ft_rebuild_duration_seconds_count" + repr(sorted({"model_name": DEMO, "trigger": "manual"}.items()))
        assert value(client, "ft_rebuild_duration_seconds_count", trigger="manual") - base.get(count_key, 0) == 1
        assert value(client, "ft_rebuild_duration_seconds_sum", trigger="manual") > 0
        assert value(client, "ft_rebuild_duration_seconds_bucket", trigger="manual", le="+Inf") == \
            value(client, "ft_rebuild_duration_seconds_count", trigger="manual")
        assert not [s for s in samples(client) if s.name.startswith("ft_rebuild_duration")
                    and s.labels.get("trigger") == "ladder"]  # the refusal ran nothing
    finally:
        assert client.post("/admin/cache", json={"kv": kv, "wait_s": WAIT_S}).status_code == 200


def _fail_next_step(e) -> None:
    """The engine's next forward step raises (once): its requests fail, the server goes on."""
    def boom(work):
        del e.runner.run  # back to the class's method
        raise RuntimeError("an injected fault")

    e.runner.run = boom


def test_errors_and_aborts_are_counted_apart(app):
    client, state = app
    before = finished(client)

    state.loop.call_sync(_fail_next_step, timeout=WAIT_S)
    r = complete(client, "this one fails", 4)
    assert r.status_code == 503 and "the request failed" in r.json()["error"]["message"]
    state.loop.call_sync(_fail_next_step, timeout=WAIT_S)
    r = complete(client, "this stream fails", 4, stream=True)
    assert r.status_code == 200 and '"code": 503' in r.text
    after_errors = finished(client)
    assert after_errors["error"] - before["error"] == 2
    assert after_errors["abort"] == before["abort"] and after_errors["cancelled"] == before["cancelled"]

    # a request still running when the server stops (the drain's end): abort, not error
    answers = []
    t = threading.Thread(target=lambda: answers.append(complete(client, "a long one", 3000)))
    t.start()
    wait_for(lambda: state.loop.call_sync(lambda e: len(e.scheduler.running), timeout=WAIT_S) == 1,
             "the long request to run")
    state.loop.call_sync(state.loop._abort_all, timeout=WAIT_S)
    t.join(WAIT_S)
    assert answers and answers[0].json()["choices"][0]["finish_reason"] == "abort"
    after = finished(client)
    assert after["abort"] - before["abort"] == 1 and after["error"] == after_errors["error"]
    assert after["cancelled"] == before["cancelled"]
    assert complete(client, "still serving", 2).status_code == 200


# --------------------------------------------------------------------------- the Grafana dashboard
def _exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard's panels (rows' nested panels included)."""
    out = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [t["expr"] for t in p.get("targets", []) if t.get("expr")]
    return out


def test_dashboard_is_a_grafana_dashboard():
    d = json.loads(DASHBOARD.read_text())
    assert 36 <= d["schemaVersion"] <= 41 and d["title"] and d["uid"]
    assert [i["name"] for i in d["__inputs"]] == ["DS_PROMETHEUS"] and d["__inputs"][0]["pluginId"] == "prometheus"
    panels = [p for panel in d["panels"] for p in [panel, *panel.get("panels", [])]]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        assert p["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]), p["title"]
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        for t in p["targets"]:
            assert "model_name=~\"$model_name\"" in t["expr"], (p["title"], t["expr"])
    titles = " | ".join(p["title"] for p in panels).lower()
    for word in ("tokens/s", "ttft", "inter-token", "end-to-end", "queue", "running", "kv", "expert hit", "pool",
                 "rebuild", "preemption"):
        assert word in titles, word


def test_dashboard_graphs_only_exported_series(app):
    """Every ft_ name in the dashboard's expressions is a sample name /metrics exports on the demo
    engine once it has served requests and rebuilt (so that a renamed series fails here)."""
    client, state = app
    complete(client, "for the dashboard", 3)
    kv = state.loop.call_sync(lambda e: e.pools.kv.num_tokens, timeout=WAIT_S)
    assert client.post("/admin/cache", json={"kv": kv // 2, "wait_s": WAIT_S}).status_code == 200
    assert client.post("/admin/cache", json={"kv": kv, "wait_s": WAIT_S}).status_code == 200
    exported = {s.name for s in samples(client)}
    d = json.loads(DASHBOARD.read_text())
    used = {m for e in _exprs(d) for m in re.findall(r"\bft_[a-z0-9_]+", e)}
    for v in d.get("templating", {}).get("list", []):
        used |= set(re.findall(r"\bft_[a-z0-9_]+", json.dumps(v.get("query", ""))))
    assert used, "the dashboard graphs nothing"
    assert sorted(used - exported) == []
    for name in ("ft_generation_tokens_total", "ft_prompt_tokens_total", "ft_time_to_first_token_seconds_bucket",
                 "ft_inter_token_latency_seconds_bucket", "ft_e2e_request_latency_seconds_bucket",
                 "ft_request_queue_time_seconds_bucket", "ft_requests_running", "ft_requests_waiting",
                 "ft_kv_cache_usage_ratio", "ft_expert_cache_hits_total", "ft_pool_bytes", "ft_rebuilds_total",
                 "ft_num_preemptions_total"):
        assert name in used, f"the dashboard has no panel on {name}"


def test_metrics_answer_while_the_engine_thread_is_busy(app):
    """/metrics reads the figures the engine thread last published: a scrape while the engine thread
    is held (as a long prefill or a rebuild holds it) answers at once with the engine's series, and
    the figures of the requests that ended before it. (It used to ask the engine thread for them
    between two steps, and waited: up to 4.4 s under load on the H200.)"""
    client, state = app
    assert complete(client, "counted before the engine is held", 3).status_code == 200
    want = state.loop.call_sync(lambda e: e.counters["generation_tokens"], timeout=WAIT_S)
    release = threading.Event()
    held = state.loop.call(lambda e: release.wait(20.0))  # (bounded: a regression fails, it does not hang)
    try:
        wait_for(lambda: held.running(), "the engine thread runs the holding command")
        got = value(client, "ft_generation_tokens_total")
        assert not held.done(), "/metrics waited for the engine thread"
        assert got == want and value(client, "ft_requests_running") == 0
    finally:
        release.set()
    held.result(WAIT_S)


def test_a_finished_request_is_in_the_next_scrape(app):
    """The figures are published before a step's tokens reach their streams: the scrape right after a
    request's answer counts its tokens (no wait, no stale figures)."""
    client, _ = app
    for n in (1, 2, 5):
        before = value(client, "ft_generation_tokens_total")
        assert complete(client, [11, 12, 13, n], n).status_code == 200
        assert value(client, "ft_generation_tokens_total") - before == n


def test_admin_events_say_how_busy_the_engine_was(app):
    """`ft top`'s busy share: the engine thread's time in steps over each tick's interval, 0..1; above 0 in
    the ticks while a request runs, and 0 again once ticks cover no step (within a few ticks after it: some
    may have been sent before its last step)."""
    client, _ = app
    with client.stream("GET", "/admin/events?interval=0.1") as r:
        lines = (x for x in r.iter_lines() if x.startswith("data:"))
        first = json.loads(next(lines)[5:])
        request = threading.Thread(target=complete, args=(client, [(5 * i) % 280 + 9 for i in range(300)], 60))
        request.start()
        busy = []
        while request.is_alive() and len(busy) < 200:
            busy.append(json.loads(next(lines)[5:])["rates"]["engine_busy"])
        request.join(WAIT_S)
        after = [json.loads(next(lines)[5:])["rates"]["engine_busy"] for _ in range(20)]
    assert first["rates"]["engine_busy"] == 0 and first["rates"]["slow_steps"] == 0  # (a first event has no interval)
    assert all(0 <= b <= 1 for b in busy + after) and max(busy + after) > 0, (busy, after)
    assert after[-1] == 0, after


def test_admin_events_tick_while_the_engine_thread_is_busy(app):
    """`ft top`'s stream (GET /admin/events) reads the published figures and cache state too: ticks keep
    coming while the engine thread is held, and they carry the geometry the engine last published."""
    client, state = app
    release = threading.Event()
    with client.stream("GET", "/admin/events?interval=0.1") as r:
        lines = (x for x in r.iter_lines() if x.startswith("data:"))
        first = json.loads(next(lines)[5:])
        held = state.loop.call(lambda e: release.wait(20.0))  # (bounded: a regression fails, it does not hang)
        try:
            wait_for(lambda: held.running(), "the engine thread runs the holding command")
            ticks = [json.loads(next(lines)[5:]) for _ in range(3)]
            assert not held.done(), "the events stream waited for the engine thread"
        finally:
            release.set()
    held.result(WAIT_S)
    assert first["kind"] == "snapshot" and [t["kind"] for t in ticks] == ["tick"] * 3
    assert {t["cache"]["pools"]["kv"]["size"] for t in ticks} == {first["cache"]["pools"]["kv"]["size"]}


def test_device_memory_gauges_on_a_cuda_device_only(app):
    """The card by the driver's count (`ft.memory.device_memory`): no ft_device_memory_* series on the CPU;
    with a CUDA reading (a stand-in probe here) the four gauges, and /admin/cache's `device` says the same."""
    import torch

    from ft.memory.device_memory import DeviceMemory, DeviceMemoryProbe

    client, state = app
    assert not [s for s in samples(client) if s.name.startswith("ft_device_memory_")]
    assert client.get("/admin/cache").json()["device"]["card_bytes"] == 0
    engine = state.loop.engine
    real = engine.device_memory
    reading = DeviceMemory(card_bytes=32 << 30, used_bytes=30 << 30, allocator_peak_bytes=27 << 30,
                           headroom_bytes=2 << 30)

    class Probe(DeviceMemoryProbe):  # a CUDA reading on the CPU
        def read(self, fresh: bool = False) -> DeviceMemory:
            return reading

    engine.device_memory = Probe(torch.device("cpu"), 0, 0)  # (read by the engine thread at its next stats)
    try:
        want = {"ft_device_memory_card_bytes": 32 << 30, "ft_device_memory_used_bytes": 30 << 30,
                "ft_device_memory_allocator_peak_bytes": 27 << 30, "ft_device_memory_headroom_bytes": 2 << 30}
        wait_for(lambda: all(s.labels["model_name"] == DEMO and s.value == want[s.name] for s in samples(client)
                             if s.name in want) and {s.name for s in samples(client)} >= set(want), "the gauges")
        wait_for(lambda: client.get("/admin/cache").json()["device"] == {  # (a view at most VIEW_INTERVAL_S old)
            "card_bytes": 32 << 30, "used_bytes": 30 << 30, "allocator_peak_bytes": 27 << 30, "headroom_bytes": 2 << 30},
            "the admin view's device")
    finally:
        engine.device_memory = real
