"""The server's app in this process, on the demo model (CPU, generated locally): faster than a
subprocess and with the engine at hand, for tests that reach into it (inject a fault, read a
counter). Requests go through Starlette's TestClient, so the lifespan starts the engine thread."""

from __future__ import annotations

from contextlib import contextmanager

from prometheus_client.parser import text_string_to_metric_families
from server_proc import WAIT_S

DEMO = "ft-demo"
API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@contextmanager
def demo_app(engine_kw: dict | None = None, **state_kw):
    """(TestClient, ServerState) of the demo model served under DEMO with API_KEY, engine up; engine_kw:
    more `EngineConfig` fields."""
    from fastapi.testclient import TestClient

    from ft.engine.core.engine import Engine
    from ft.engine.base.engine_config import EngineConfig
    from ft.server.app import ServerState, create_app
    from ft.server.engine_loop import EngineLoop

    loop = EngineLoop(lambda: Engine(EngineConfig(device="cpu", **(engine_kw or {}))))
    state = ServerState(loop, DEMO, api_key=API_KEY, drain_s=0.0, **state_kw)
    with TestClient(create_app(state)) as client:
        assert loop.ready.wait(WAIT_S) and loop.state == "serving", loop.error
        yield client, state


def samples(client) -> list:
    """Every sample of /metrics (prometheus_client's parser: name, labels, value)."""
    r = client.get("/metrics")
    assert r.status_code == 200
    return [s for fam in text_string_to_metric_families(r.text) for s in fam.samples]


def value(client, name: str, **labels) -> float:
    """The sample `name` (as exposed: counters end in _total) whose labels include `labels`; the
    model_name label is DEMO unless given. AssertionError when there is no such sample."""
    want = {"model_name": DEMO, **{k: str(v) for k, v in labels.items()}}
    for s in samples(client):
        if s.name == name and all(s.labels.get(k) == v for k, v in want.items()):
            return s.value
    raise AssertionError(f"no sample {name}{want} in /metrics")


def complete(client, prompt, max_tokens: int, **kw):
    """POST /v1/completions with the key; the response."""
    body = {"model": DEMO, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}
    return client.post("/v1/completions", json=body, headers=AUTH)
