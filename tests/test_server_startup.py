"""In-process checks of the app: /health is 503 while the engine starts, and a failed start. The
engine's start is held by an event, never by a timer."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
from server_proc import WAIT_S

from ft.server.app import ServerState, create_app
from ft.server.engine_loop import EngineLoop


class _FakeEngine:
    has_work = False
    context_limit = 16
    cache = SimpleNamespace(degraded=None)  # /health reads why the server is degraded, if it is


def _get(app, path):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path)

    return asyncio.run(go())


def test_health_is_503_until_the_engine_is_up():
    release = threading.Event()

    def build():
        release.wait()
        return _FakeEngine()

    loop = EngineLoop(build)
    app = create_app(ServerState(loop, "m"), start_loop=False)
    loop.start()
    try:
        r = _get(app, "/health")
        assert r.status_code == 503 and r.json()["status"] == "starting"
        assert _get(app, "/v1/models").status_code == 503
    finally:
        release.set()
    assert loop.ready.wait(WAIT_S)
    assert _get(app, "/health").status_code == 200
    loop.stop()


def test_failed_start_is_reported():
    def build():
        raise ValueError("no config.json at /nowhere")

    loop = EngineLoop(build)
    app = create_app(ServerState(loop, "m"), start_loop=False)
    loop.start()
    assert loop.ready.wait(WAIT_S)
    r = _get(app, "/health")
    assert r.status_code == 503 and "no config.json" in r.json()["error"]
