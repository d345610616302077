"""In-process checks of the app: /health is 503 while the engine starts, and a failed start."""

from __future__ import annotations

import asyncio
import threading

import httpx

from ft.server.app import ServerState, create_app
from ft.server.engine_loop import EngineLoop


class _FakeEngine:
    has_work = False
    context_limit = 16


def _get(app, path):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get(path)

    return asyncio.run(go())


def test_health_is_503_until_the_engine_is_up():
    release = threading.Event()

    def build():
        release.wait(10)
        return _FakeEngine()

    loop = EngineLoop(build)
    app = create_app(ServerState(loop, "m"), start_loop=False)
    loop.start()
    r = _get(app, "/health")
    assert r.status_code == 503 and r.json()["status"] == "starting"
    assert _get(app, "/v1/models").status_code == 503
    release.set()
    assert loop.ready.wait(5)
    assert _get(app, "/health").status_code == 200
    loop.stop()


def test_failed_start_is_reported():
    def build():
        raise ValueError("no config.json at /nowhere")

    loop = EngineLoop(build)
    app = create_app(ServerState(loop, "m"), start_loop=False)
    loop.start()
    assert loop.ready.wait(5)
    r = _get(app, "/health")
    assert r.status_code == 503 and "no config.json" in r.json()["error"]
