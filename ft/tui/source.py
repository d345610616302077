"""Where `ft top` gets its state: the server-sent events of GET /admin/events, or polling
GET /admin/cache when the stream is not there (an older server, or a client without a URL).

`EventSource.run` never returns: it reports each state as an `Update` and each change of the
connection as a `Status`, and reconnects with backoff (0.5 s doubling to 10 s). A 401 / 403 is not
a connection problem: it says which token to set and waits long (60 s doubling to 10 min) before
asking again; `retry_now()` (the dashboard's R key) cuts any wait short. The running and waiting
requests (GET /admin/requests) come with the updates, at most once a refresh interval. Payloads
parse leniently: a field of the wrong type is dropped (its default is used), so an old or partial
server never crashes the dashboard. No Textual here, no torch.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from ft.ctl.client import EXIT_UNREACHABLE, CtlError
from ft.schemas import CacheState, Event, History, LiveRates, RequestList
from ft.tui.state import backoff_delays

M = TypeVar("M", bound=BaseModel)
HISTORY_EVERY_S = 5.0  # history is also fetched on every snapshot / change / rebuild event
UNAUTHORIZED = "unauthorized (set --admin-token / $FT_ADMIN_TOKEN)"


def unauthorized_delays():
    """Waits after a 401 / 403: a wrong token does not fix itself, so ask again rarely."""
    return backoff_delays(60.0, 2.0, 600.0)


def unauthorized_message(status: int | None, token: str | None) -> str:
    why = "the server rejected the admin token" if token else "the server needs an admin token"
    return f"{UNAUTHORIZED}: {why}" + (f" (HTTP {status})" if status else "")


@dataclass
class Update:
    event: Event
    history: History | None = None  # None: unchanged since the last update
    # the running and waiting requests; None: not fetched this time; a str: why there is no list
    requests: RequestList | str | None = None


@dataclass
class Status:
    connected: bool
    message: str = ""
    retry_in: float = 0.0
    unauthorized: bool = False


def lenient(model: type[M], data: Any) -> M:
    """`model.model_validate(data)`, dropping each field that fails (up to 50) so its default
    applies; a payload that is not even an object gives the model's defaults."""
    if not isinstance(data, dict):
        return model()
    data = json.loads(json.dumps(data))  # a private copy to prune
    for _ in range(50):
        try:
            return model.model_validate(data)
        except ValidationError as e:
            if not _prune(data, e.errors()[0]["loc"]):
                return model()
    return model()


def _prune(data: Any, loc: tuple) -> bool:
    node, path = data, list(loc)
    # walk to the deepest container the location names, then drop the key below it
    while len(path) > 1:
        key = path[0]
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            break
        path.pop(0)
    key = path[0] if path else None
    if isinstance(node, dict) and key in node:
        del node[key]
        return True
    if isinstance(node, list) and isinstance(key, int) and key < len(node):
        del node[key]
        return True
    return False


class Unauthorized(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class EventSource:
    """State for the dashboard, from `client` (an `AdminClient` or anything with `cache()` and
    `history()`), streamed from `url` when `stream` is true, else polled every `refresh` s."""

    def __init__(self, client: Any, refresh: float = 1.0, stream: bool = True, url: str | None = None,
                 token: str | None = None, transport: httpx.AsyncBaseTransport | None = None):
        self.client = client
        self.refresh = max(0.1, float(refresh))
        self.stream = stream and bool(url)
        self.url = url
        self.token = token
        self.transport = transport
        self._last_history_t = -1e9
        self._last_requests_t = -1e9
        self._requests_gone: str | None = None  # why this server has no request list (an older one)
        self._loop_time: Callable[[], float] = lambda: asyncio.get_running_loop().time()
        self._wake: asyncio.Event | None = None

    def retry_now(self) -> None:
        """End the wait before the next attempt (the user asked)."""
        if self._wake is not None:
            self._wake.set()

    async def run(self, on_update: Callable[[Update], None], on_status: Callable[[Status], None]) -> None:
        self._wake = asyncio.Event()
        delays, auth_delays = backoff_delays(), unauthorized_delays()
        while True:
            ok = [False]

            def connected(status_ok: Status) -> None:
                ok[0] = True
                on_status(status_ok)

            self._wake.clear()
            try:
                if self.stream:
                    await self._run_stream(on_update, connected)
                else:
                    await self._run_poll(on_update, connected)
                message = f"the event stream from {self.url} ended"
                unauthorized = False
            except Unauthorized as e:
                message, unauthorized = unauthorized_message(e.status, self.token), True
            except CtlError as e:
                unauthorized = e.status in (401, 403)
                message = unauthorized_message(e.status, self.token) if unauthorized else e.message
            except (httpx.HTTPError, OSError, ValueError) as e:
                reason = " ".join(str(e).split()) or type(e).__name__
                message, unauthorized = f"cannot reach the server at {self.url} ({reason})", False
            if ok[0]:
                delays, auth_delays = backoff_delays(), unauthorized_delays()
            delay = next(auth_delays if unauthorized else delays)
            on_status(Status(False, message, delay, unauthorized))
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _history_due(self, kind: str) -> History | None:
        now = self._loop_time()
        if kind == "tick" and now - self._last_history_t < HISTORY_EVERY_S:
            return None
        self._last_history_t = now
        try:
            return await asyncio.to_thread(self.client.history)
        except CtlError:
            return None

    async def _requests_due(self) -> RequestList | str | None:
        """The request list, at most once a refresh interval; a str says why there is none."""
        if self._requests_gone is not None or not hasattr(self.client, "requests"):
            return None
        now = self._loop_time()
        if now - self._last_requests_t < self.refresh * 0.9:
            return None
        self._last_requests_t = now
        try:
            return await asyncio.to_thread(self.client.requests)
        except CtlError as e:
            if e.status in (404, 405):
                self._requests_gone = "this server has no request list (GET /admin/requests): an older ft serve"
                return self._requests_gone
            return e.message

    async def _update(self, on_update, event: Event) -> None:
        history = await self._history_due(event.kind)
        requests = await self._requests_due()
        on_update(Update(event, history, requests))

    async def _run_stream(self, on_update, connected) -> None:
        headers = {"Accept": "text/event-stream", "User-Agent": "ft-top"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        timeout = httpx.Timeout(max(10.0, 5 * self.refresh), connect=5.0)
        async with httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout,
                                     transport=self.transport) as http:
            async with http.stream("GET", "/admin/events", params={"interval": self.refresh}) as r:
                if r.status_code in (401, 403):
                    raise Unauthorized(r.status_code)
                if r.status_code in (404, 405):
                    self.stream = False  # an older server: poll instead
                    return
                if r.status_code != 200:
                    raise CtlError(f"the event stream answered HTTP {r.status_code}", EXIT_UNREACHABLE, r.status_code)
                connected(Status(True, f"streaming from {self.url}"))
                data_lines: list[str] = []
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        data_lines.append(line[5:].lstrip())
                    elif not line.strip() and data_lines:
                        try:
                            payload = json.loads("\n".join(data_lines))
                        except ValueError:
                            payload = None
                        data_lines = []
                        if payload is None:
                            continue
                        await self._update(on_update, lenient(Event, payload))

    async def _run_poll(self, on_update, connected) -> None:
        prev: CacheState | None = None
        first = True
        while True:
            cache = await asyncio.to_thread(self.client.cache)
            if first:
                connected(Status(True, "polling"))
            kind = "snapshot" if first else ("change" if prev is not None and _key(prev) != _key(cache) else "tick")
            await self._update(on_update, Event(kind=kind, cache=cache, rates=rates_between(prev, cache)))
            prev, first = cache, False
            await asyncio.sleep(self.refresh)


def _key(c: CacheState) -> tuple:
    return c.state, c.pools.moe.size, c.pools.kv.size, c.pools.mamba.size


def rates_between(prev: CacheState | None, cur: CacheState) -> LiveRates:
    """What polling can tell: KV usage now, the expert hit rate between two polls (decode
    tokens/s and the engine's busy share need the event stream: 0 here)."""
    kv = cur.pools.kv
    rates = LiveRates(kv_usage=kv.used / kv.pages if kv.pages else 0.0, expert_hit_rate=cur.pools.moe.hit_rate)
    if prev is not None:
        dh = cur.pools.moe.hits - prev.pools.moe.hits
        dm = cur.pools.moe.misses - prev.pools.moe.misses
        if dh >= 0 and dm >= 0 and dh + dm > 0:
            rates.expert_hit_rate = dh / (dh + dm)
    return rates
