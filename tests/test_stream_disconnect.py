"""A streamed request whose client leaves while the server is still sending the choices' openings
(chat with n > 1 sends one role chunk per choice before any token): every choice must be aborted,
not decoded to max_tokens for nobody. Driven at the ASGI level so that the moment is exact: the
first body chunk's send blocks, the client's next receive is the disconnect."""

from __future__ import annotations

import gc
import json
import time

import anyio
from inproc_server import API_KEY, DEMO, demo_app

MAX_TOKENS = 200


def test_client_leaving_during_the_openings_aborts_every_choice():
    gc.disable()  # NOTE: the aborts must not wait for the cyclic collector (the generator's finally
    try:          # ran only at collection before ClosingStreamingResponse: 20 s late in a full test run)
        _client_leaves_during_the_openings()
    finally:
        gc.enable()


def _client_leaves_during_the_openings() -> None:
    with demo_app() as (client, state):
        engine = state.loop.engine
        before = engine.counters["generation_tokens"]
        body = json.dumps({"model": DEMO, "messages": [{"role": "user", "content": "hello"}], "n": 3,
                           "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True}).encode()
        sent: list[dict] = []

        async def drive() -> None:
            first_chunk = anyio.Event()
            asked = {"body": False}

            async def receive() -> dict:
                if not asked["body"]:
                    asked["body"] = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await first_chunk.wait()  # the client leaves once the first opening has been sent
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)
                if message["type"] == "http.response.body" and message.get("body"):
                    first_chunk.set()
                    await anyio.sleep(60)  # the client reads no further: cancelled by the disconnect

            scope = {
                "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
                "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {API_KEY}".encode()),
                            (b"content-length", str(len(body)).encode())],
            }
            with anyio.fail_after(30):
                await client.app(scope, receive, send)

        client.portal.call(drive)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert b'"role":"assistant"' in sent[1]["body"].replace(b" ", b"")  # an opening, no token yet
        deadline = time.monotonic() + 20
        while engine.scheduler.running or engine.scheduler.waiting:
            assert time.monotonic() < deadline, "the choices still run after the client left"
            time.sleep(0.05)
        assert engine.counters["generation_tokens"] - before < 3 * MAX_TOKENS  # aborted, not run to their ends
