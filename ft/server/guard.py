"""The server's front door, as plain ASGI middleware: body size and read time limits, the API key,
the engine's state. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which runs the route in
a task of its own and hides the client's disconnect from it (a non-streaming request then decoded
to its end for nobody).

A request body is read here, in full, before the route sees it: counted as it arrives (a chunked
body has no Content-Length to check up front), refused with 413 once it passes the limit, and with
408 when the client stops sending for `body_timeout_s`. The route then reads the buffered body;
after it, `receive` is the client's again, so `request.is_disconnected()` sees the disconnect.
After a request with a large body the freed heap goes back to the system (`ft.server.heap`).
"""

from __future__ import annotations

import asyncio
import hmac
import json

from ft.server.heap import LARGE_BODY_BYTES, release_freed_memory
from ft.server.util_routes import API_KEY_PATHS


class Guard:
    def __init__(self, app, state, body_timeout_s: float = 30.0) -> None:
        self.app, self.state, self.body_timeout_s = app, state, body_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.state
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > st.max_body_bytes:
            return await _error(send, 413, f"request body is {length} bytes; the limit is {st.max_body_bytes}")
        path = scope.get("path", "")
        if path.startswith("/v1/") or path in API_KEY_PATHS:
            if st.api_key and not hmac.compare_digest(headers.get("authorization", "").encode(),
                                                      f"Bearer {st.api_key}".encode()):
                return await _error(send, 401, "missing or wrong API key: Authorization: Bearer <key>",
                                    "authentication_error")
            if st.loop.state != "serving":  # loading, or failed (the reason said: a supervisor restarts it)
                reason = f"the engine is {st.loop.state}" + (f": {st.loop.error}" if st.loop.error is not None else "")
                return await _error(send, 503, reason, "server_unavailable", retry_after_s=5)
        if scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE") and not length:
            return await self.app(scope, receive, send)
        body, problem = await self._read_body(receive)
        if problem is not None:
            return await _error(send, *problem)
        try:
            return await self.app(scope, _replay(body, receive), send)
        finally:
            if len(body) >= LARGE_BODY_BYTES:  # its tokens are freed now: give the heap back (off the loop)
                asyncio.get_running_loop().run_in_executor(None, release_freed_memory)

    async def _read_body(self, receive) -> tuple[bytes, tuple | None]:
        """The whole body, or an error (status, message, type) to answer instead."""
        limit, chunks, total = self.state.max_body_bytes, [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                return b"", (408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                             "timeout")
            if message["type"] == "http.disconnect":
                return b"", (400, "the client went away before sending the whole body")
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                return b"", (413, f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive):
    """A `receive` that gives the buffered body once, then the client's messages (its disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _error(send, status: int, message: str, type_: str = "invalid_request_error",
                 retry_after_s: int | None = None) -> None:
    payload = json.dumps({"error": {"message": message, "type": type_, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if retry_after_s is not None:
        headers.append((b"retry-after", str(retry_after_s).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
