"""A real `ft serve` (demo model) on a loopback port, driven by the openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from server_proc import ServerProcess

MODEL = "ft-demo"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-running-requests", "8", "--num-tokens", "4096", "--moe-cache-size", "64")
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def healthy(server) -> bool:
    return httpx.get(server.url + "/health").status_code == 200


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert healthy(server)


def test_completion_usage_and_length(server, client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == len("Hello there".encode()) or r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_prompt_as_token_ids(server, client):
    r = client.completions.create(model=MODEL, prompt=[72, 101, 108, 108, 111], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 3


def chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_chat_and_streaming_agree(server, client):
    kw = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = chat(client, "Tell me a story", **kw)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 12
    chunks = list(chat(client, "Tell me a story", stream=True, stream_options={"include_usage": True}, **kw))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 3  # tokens arrive one event at a time
    assert "".join(pieces) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_seed_is_reproducible(server, client):
    kw = dict(max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    a = chat(client, "x", seed=42, **kw).choices[0].message.content
    b = chat(client, "x", seed=42, **kw).choices[0].message.content
    c = chat(client, "x", seed=43, **kw).choices[0].message.content
    assert a == b != c


def test_stop_string_cuts_text(server, client):
    kw = dict(max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    text = chat(client, "abc", **kw).choices[0].message.content
    needle = text[8:10]
    r = chat(client, "abc", stop=[needle], **kw)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == text[: text.index(needle)]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, "abc", stop=[needle], stream=True, **kw))
    assert streamed == text[: text.index(needle)]


def test_sixteen_concurrent_streams_match_alone(server):
    prompts = [f"Request number {i}: tell me about the number {i * 7}" for i in range(16)]
    kw = dict(max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    sync = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    alone = [chat(sync, p, **kw).choices[0].message.content for p in prompts]

    async def one(ac, p):
        text = ""
        async for c in await ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": p}], stream=True, **kw
        ):
            if c.choices and c.choices[0].delta.content:
                text += c.choices[0].delta.content
        return text

    async def main():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(ac, p) for p in prompts))

    assert asyncio.run(main()) == alone


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ("{not json", 400, "invalid request"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**9}, 400, "maximum context length is 8192"),
        ({"model": MODEL, "prompt": "a" * 9000}, 400, "context limit is 8192"),
        ({"model": MODEL, "prompt": [1, 2, 99999]}, 400, "outside the vocabulary"),
        ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n must be 1"),
        ({"model": MODEL, "prompt": "x", "temperature": -3}, 400, "temperature"),
        ({"model": MODEL}, 400, "prompt"),
    ],
    ids=["malformed", "unknown-model", "negative-max", "absurd-max", "long-prompt", "bad-token", "n2", "neg-temp", "no-prompt"],
)
def test_bad_input_is_4xx_and_server_stays_healthy(server, body, status, needle):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert healthy(server)


def test_body_size_limit(server):
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (9 * 1024 * 1024),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_disconnect_cancels_and_frees(server):
    with httpx.stream("POST", server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "long", "max_tokens": 3000, "stream": True, "ignore_eos": True, "temperature": 0,
    }) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data:") for line in got)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = httpx.get(server.url + "/admin/cache").json()
        if state["running"] == 0:
            break
        time.sleep(0.1)
    assert state["running"] == 0 and state["pools"]["mamba"]["used"] <= state["pools"]["mamba"]["size"]


def test_metrics_names(server, client):
    chat(client, "metrics please", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("ft_requests_running", "ft_requests_waiting", "ft_kv_tokens_used", "ft_kv_tokens_capacity",
                 "ft_expert_cache_hits_total", "ft_expert_cache_misses_total", 'ft_pool_bytes{pool="moe"}',
                 "ft_prompt_tokens_total", "ft_generation_tokens_total", "ft_time_to_first_token_seconds_bucket",
                 "ft_inter_token_latency_seconds_bucket", "ft_cache_budget_bytes"):
        assert name in text, name


def test_admin_cache_state_and_resize_answers(server):
    st = httpx.get(server.url + "/admin/cache").json()
    assert st["state"] == "serving" and st["pools"]["moe"]["size"] == 64 and st["pools"]["kv"]["size"] == 4096
    assert st["pools"]["kv"]["page_size"] == 64 and st["pools"]["kv"]["pages"] == 64
    for pool in ("moe", "kv", "mamba"):
        p = st["pools"][pool]
        assert p["min"] <= p["size"] <= p["max"] and p["bytes"] > 0
    kv_max = st["pools"]["kv"]["max"]
    r = httpx.post(server.url + "/admin/cache", json={"kv": kv_max + 64})
    assert r.status_code == 422 and f"kv {kv_max + 64} is outside" in r.json()["error"]["message"]
    assert "reachable ranges: moe" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/admin/cache").json()["pools"] == httpx.get(server.url + "/admin/cache").json()["pools"]
    plan = httpx.post(server.url + "/admin/cache", json={"kv": kv_max, "dry_run": True}).json()
    assert plan["fits"] and plan["peak_bytes"] <= plan["budget_bytes"] and plan["steps"][0]["pool"] == "kv"
    plan = httpx.post(server.url + "/admin/cache", json={"moe": 32, "kv": kv_max, "dry_run": True}).json()
    assert [s["action"] for s in plan["steps"]] == ["shrink moe", "grow kv"]
    r = httpx.post(server.url + "/admin/cache", json={"kv": kv_max, "wait_s": 30})
    assert r.status_code == 200 and r.json()["pools"]["kv"]["size"] == kv_max
    r = httpx.post(server.url + "/admin/cache", json={"kv": st["pools"]["kv"]["size"]})
    assert r.status_code == 200 and r.json()["pools"]["kv"]["size"] == st["pools"]["kv"]["size"]
    assert httpx.post(server.url + "/admin/cache", json={"kv": "lots"}).status_code == 400
    hist = httpx.get(server.url + "/admin/cache/history").json()["entries"]
    assert hist[-1]["trigger"] == "startup" and hist[-1]["to"]["moe"] == 64
    assert [h["to"]["kv"] for h in hist[:2]] == [4096, kv_max] and hist[0]["status"] == "ok"


def test_admin_events_snapshot_then_ticks(server):
    kinds = []
    with httpx.stream("GET", server.url + "/admin/events?interval=0.2", timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                ev = json.loads(line[5:])
                kinds.append(ev["kind"])
                assert ev["cache"]["state"] == "serving"
                if len(kinds) == 3:
                    break
    assert kinds == ["snapshot", "tick", "tick"]


def test_tokens_and_shutdown_drain():
    srv = ServerProcess("--api-key", "sk-test", "--admin-token", "adm", "--num-tokens", "1024", "--drain-timeout", "20")
    try:
        assert httpx.get(srv.url + "/admin/cache").status_code == 401
        assert httpx.get(srv.url + "/admin/cache", headers={"authorization": "Bearer adm"}).status_code == 200
        assert httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sk-test", max_retries=0)
        result = {}

        def long_request():
            result["r"] = c.completions.create(model=MODEL, prompt="drain me", max_tokens=60, temperature=0,
                                               extra_body={"ignore_eos": True})

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.0)
        code = srv.stop(signal.SIGTERM)
        t.join(30)
        assert code == 0
        assert result["r"].usage.completion_tokens == 60  # the running request was allowed to finish
    finally:
        srv.stop()


def test_ft_ctl_against_the_server(server, capsys):
    from ft.ctl.cli import main as ctl
    from ft.schemas import CacheState, History

    assert ctl(["cache", "--url", server.url]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("state=serving, ") and "allocated (rebuild budget" in out[0]
    assert out[1].split()[:3] == ["moe", "64", "slots"] and "(lru, 12.5%)" in out[1]
    assert out[2].split()[:3] == ["kv", "4096", "tok"] and "(64 x 64)" in out[2]
    assert out[3].split()[0] == "mamba" and out[4].strip() == "ladder off"
    assert ctl(["cache", "--json", "--url", server.url]) == 0
    state = CacheState.model_validate_json(capsys.readouterr().out)
    assert state.pools.kv.size == 4096 and state.state == "serving"
    kv_max = state.pools.kv.max
    assert ctl(["cache", "--kv", str(kv_max + 64), "--url", server.url]) == 1
    err = capsys.readouterr().err
    assert f"kv {kv_max + 64} is outside" in err and len(err.strip().splitlines()) == 1
    assert ctl(["cache", "--kv", str(kv_max), "--dry-run", "--url", server.url]) == 0
    assert "fits" in capsys.readouterr().out
    assert ctl(["history", "--json", "--url", server.url]) == 0
    assert History.model_validate_json(capsys.readouterr().out).entries[-1].trigger == "startup"
    assert ctl(["cache", "--url", "http://127.0.0.1:9"]) == 3


def test_seed_resizes_through_the_admin_api_and_ft_ctl(capsys):
    """The seeds' scenario on the demo model: a nearly full card; growing moe while shrinking kv
    (and mamba) needs the shrinks to free first."""
    from ft.ctl.cli import main as ctl

    srv = ServerProcess("--num-tokens", "8192", "--mamba-cache-size", "16")
    try:
        st = httpx.get(srv.url + "/admin/cache").json()
        assert st["allocated_bytes"] > 0.99 * st["budget_bytes"]
        assert ctl(["cache", "--moe", "300", "--kv", "2048", "--wait", "60", "--url", srv.url]) == 0
        assert "moe    300 slots" in capsys.readouterr().out
        r = httpx.post(srv.url + "/admin/cache", json={"moe": 400, "kv": 512, "mamba": 4, "wait_s": 60})
        assert r.status_code == 200
        pools = r.json()["pools"]
        assert (pools["moe"]["size"], pools["kv"]["size"], pools["mamba"]["size"]) == (400, 512, 4)
        hi = pools["moe"]["max"]
        r = httpx.post(srv.url + "/admin/cache", json={"moe": hi + 1})
        assert r.status_code == 422 and f"moe {hi + 1} is outside" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/admin/cache").json()["pools"] == pools
        hist = httpx.get(srv.url + "/admin/cache/history").json()["entries"]
        assert [h["status"] for h in hist] == ["ok", "ok", "ok"]
        for h in hist[:2]:
            assert h["measured_peak_bytes"] <= h["peak_bytes"] <= st["budget_bytes"]
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        assert chat(c, "still serving", max_tokens=4, temperature=0).usage.completion_tokens >= 1
    finally:
        srv.stop()


def test_ladder_through_the_server_and_ft_ctl(capsys):
    from ft.ctl.cli import main as ctl

    srv = ServerProcess("--enable-kv-ladder", "--ladder-step-size", "256", "--ladder-dwell-s", "0",
                        "--ladder-grow-hold-s", "0")
    try:
        st = httpx.get(srv.url + "/admin/cache").json()
        assert st["ladder"]["enabled"] and st["ladder"]["current"] == 0 and st["pools"]["kv"]["size"] == 512
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        c.completions.create(model=MODEL, prompt="climb", max_tokens=1500, temperature=0, stop=["e"],
                             extra_body={"ignore_eos": True}).usage  # may need 1500 tokens: grows
        st = httpx.get(srv.url + "/admin/cache").json()
        assert st["pools"]["kv"]["size"] == 1536 and st["ladder"]["current"] == 4
        assert ctl(["ladder", "--up", "--url", srv.url]) == 0
        assert httpx.get(srv.url + "/admin/cache").json()["pools"]["kv"]["size"] == 1792
        assert ctl(["ladder", "--rung", "1", "--url", srv.url]) == 0
        assert ctl(["ladder", "--auto", "off", "--url", srv.url]) == 0
        capsys.readouterr()
        assert ctl(["cache", "--url", srv.url]) == 0
        out = capsys.readouterr().out
        assert "kv     768 tok" in out and "ladder auto off" in out
        assert ctl(["ladder", "--rung", "99", "--url", srv.url]) == 1
        assert "rung 99 is outside" in capsys.readouterr().err
        hist = httpx.get(srv.url + "/admin/cache/history").json()["entries"]
        assert [h["trigger"] for h in hist[:3]] == ["ladder", "ladder", "ladder"]
        assert hist[0]["reason"] == "manual: rung 1"
    finally:
        srv.stop()


def test_resize_waits_for_running_requests(server):
    """A KV target below what a running request holds: refused at once without a wait, done
    once the request finishes when the caller waits (admission pauses meanwhile)."""
    before = httpx.get(server.url + "/admin/cache").json()["pools"]["kv"]["size"]
    result = {}

    def long_request():
        result["r"] = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": [40 + i % 200 for i in range(100)], "max_tokens": 10, "temperature": 0,
            "ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/admin/cache", timeout=30).json()["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    r = httpx.post(server.url + "/admin/cache", json={"kv": 64}, timeout=30)
    assert r.status_code == 422 and "kv 64 is outside" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/admin/cache", json={"kv": 64, "wait_s": 60}, timeout=70)
    t.join(60)
    assert r.status_code == 200 and r.json()["pools"]["kv"]["size"] == 64
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 10
    assert httpx.post(server.url + "/admin/cache", json={"kv": before, "wait_s": 10}, timeout=30).status_code == 200
