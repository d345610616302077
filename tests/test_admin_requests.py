"""GET /admin/requests: the running and waiting requests (id, state, prompt and generated tokens, KV
pages, age), built on the engine thread. The states of real `Sequence` objects as the scheduler
leaves them, then a real `ft serve` (the small checkpoint, one running request at a time, an admin
token) with one request decoding and one queued behind it. Every wait polls a condition."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from server_proc import HTTP_TIMEOUT, SERVE_MODEL, ServerProcess, wait_for

from ft.ctl.client import AdminClient, CtlError
from ft.engine.base.sampling_params import SamplingParams
from ft.engine.base.sequence import Sequence, Status
from ft.schemas import RequestList
from ft.engine.core.admin import requests as _requests

TOKEN = "adm-requests"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PAGE = 64


def seq(prompt: int, out: int = 0, computed: int = 0, pages: int = 0, status=Status.RUNNING, age: float = 0.0):
    s = Sequence(list(range(prompt)), SamplingParams(), 100, frozenset())
    s.output_ids, s.num_computed, s.pages, s.status = list(range(out)), computed, list(range(pages)), status
    s.queued_at = time.time() - age
    return s


def fake_engine(running, waiting):
    return SimpleNamespace(scheduler=SimpleNamespace(running=running, waiting=waiting), started_at=time.time() - 50,
                           started_monotonic=time.monotonic() - 50, waiting_requests=lambda: list(waiting))


def test_states_from_the_scheduler_lists():
    chunked = seq(300, computed=128, pages=2)  # a chunked prefill half way
    decoding = seq(10, out=5, computed=14, pages=1, age=3.0)
    recompute = seq(10, out=5, computed=4, pages=1)  # preempted, admitted again: recomputing
    first = seq(1, pages=1)  # a one-token prompt before its first token
    queued = seq(20, status=Status.WAITING, age=1.5)
    preempted = seq(10, out=7, status=Status.WAITING)
    got = _requests(fake_engine([chunked, decoding, recompute, first], [queued, preempted]))
    assert [(r.id, r.state) for r in got.requests] == [
        (chunked.request_id, "prefill"), (decoding.request_id, "decode"), (recompute.request_id, "prefill"),
        (first.request_id, "prefill"), (queued.request_id, "waiting"), (preempted.request_id, "waiting")]
    d = got.requests[1]
    assert (d.prompt_tokens, d.generated_tokens, d.kv_pages) == (10, 5, 1) and 3.0 <= d.age_s < 60
    assert got.requests[5].generated_tokens == 7 and got.requests[5].kv_pages == 0
    assert (got.running, got.waiting, got.truncated) == (4, 2, False)
    assert 50 <= got.uptime_s < 100 and got.started_at > 0
    cut = _requests(fake_engine([chunked, decoding], [queued]), limit=2)
    assert [r.id for r in cut.requests] == [chunked.request_id, decoding.request_id]
    assert (cut.running, cut.waiting, cut.truncated) == (2, 1, True)


@pytest.fixture(scope="module")
def server(serve_checkpoint):
    old = os.environ.get("FT_ADMIN_TOKEN")
    os.environ["FT_ADMIN_TOKEN"] = TOKEN  # the way the help prefers (a flag shows in ps)
    try:
        srv = ServerProcess("--model", str(serve_checkpoint), "--max-running-requests", "1")
    finally:
        if old is None:
            del os.environ["FT_ADMIN_TOKEN"]
        else:
            os.environ["FT_ADMIN_TOKEN"] = old
    yield srv
    srv.stop()


def listing(server, **params) -> dict:
    r = server.get("/admin/requests", headers=AUTH, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_requests_route_needs_the_admin_token(server):
    assert server.get("/admin/requests").status_code == 401
    assert server.get("/admin/requests", headers={"authorization": "Bearer nope"}).status_code == 401
    idle = listing(server)
    assert idle == {**idle, "requests": [], "running": 0, "waiting": 0, "truncated": False}
    assert idle["started_at"] > 0
    assert server.get("/admin/requests", headers=AUTH, params={"limit": 0}).status_code == 400


def test_one_decoding_one_waiting(server):
    """One request streams (so it decodes: its first token is out), a second queues behind it
    (one running request at most); both are listed with their figures, then gone once aborted."""
    prompt_a, prompt_b = [40 + i for i in range(70)], [50 + i for i in range(9)]
    body = dict(model=SERVE_MODEL, max_tokens=6000, temperature=0, ignore_eos=True, stream=True)
    t0 = time.monotonic()
    with httpx.stream("POST", server.url + "/v1/completions", timeout=HTTP_TIMEOUT,
                      json={**body, "prompt": prompt_a}) as a:
        lines = a.iter_lines()
        first = json.loads(next(x for x in lines if x.startswith("data:"))[5:])
        assert first["choices"]
        b_done = threading.Event()

        def queue_b():
            try:
                with httpx.stream("POST", server.url + "/v1/completions", timeout=HTTP_TIMEOUT,
                                  json={**body, "prompt": prompt_b, "max_tokens": 3}) as b:
                    for _ in b.iter_lines():
                        pass
            finally:
                b_done.set()

        tb = threading.Thread(target=queue_b, daemon=True)
        tb.start()
        st = wait_for(lambda: (x := listing(server))["waiting"] == 1 and x, "the second request to queue", poll=0.02)
        assert st["running"] == 1 and len(st["requests"]) == 2
        run, wait = st["requests"]
        assert run["state"] == "decode" and run["prompt_tokens"] == 70 and run["generated_tokens"] >= 1
        assert run["kv_pages"] >= -(-(70 + run["generated_tokens"] - 1) // PAGE)  # its tokens' pages, at least
        assert 0 <= run["age_s"] <= time.monotonic() - t0 + 1
        assert wait == {**wait, "state": "waiting", "prompt_tokens": 9, "generated_tokens": 0, "kv_pages": 0}
        assert run["id"] != wait["id"]
        later = wait_for(lambda: (x := listing(server))["requests"] and x["requests"][0]["id"] == run["id"]
                         and x["requests"][0]["generated_tokens"] > run["generated_tokens"] and x, "more tokens")
        assert later["requests"][0]["age_s"] > run["age_s"] and later["uptime_s"] > st["uptime_s"]
        # the same through the client `ft top` uses
        with AdminClient(server.url, TOKEN, timeout=60) as c:
            got = c.requests()
        assert isinstance(got, RequestList) and {r.id for r in got.requests} >= {run["id"]}
        with AdminClient(server.url, None, timeout=60) as c, pytest.raises(CtlError) as e:
            c.requests()
        assert e.value.status == 401
    # A's client is gone: A is aborted, B runs its three tokens and ends
    assert b_done.wait(120)
    wait_for(lambda: listing(server)["requests"] == [], "the list to empty")


def test_the_server_reaches_the_engine_by_named_commands_only():
    """ft/server names engine commands (`EngineAdmin.COMMANDS`) and passes plain data: no route module
    hands the engine thread a function (a lambda) that reaches into the engine, and an unknown
    command is refused before anything is queued."""
    import asyncio
    import inspect
    import re

    from ft.engine.core.admin import EngineAdmin
    from ft.server import admin_routes, app, engine_loop

    for module in (admin_routes, app):
        src = inspect.getsource(module)
        assert not re.search(r"acall\(|call_sync\(|lambda e\b|lambda engine\b", src), module.__name__
    assert all(callable(getattr(EngineAdmin, name)) for name in EngineAdmin.COMMANDS)
    loop = engine_loop.EngineLoop(lambda: None)
    try:
        asyncio.run(loop.command("shutdown_everything"))
    except ValueError as e:
        assert "no engine command 'shutdown_everything'" in str(e)
    else:
        raise AssertionError("an unknown command was accepted")
    assert loop._commands.empty()
