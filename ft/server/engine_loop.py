"""The engine thread: one loop that owns the engine (and so every tensor).

The asyncio side talks to it only through a thread-safe command queue: `submit` a request,
`abort` one, or `call` any function on the engine between two forward steps (admin commands).
Tokens flow back per request through an asyncio queue fed with `call_soon_threadsafe`, so the
event loop never blocks on the engine. The engine's figures (`Engine.stats`, an immutable
`EngineStats`) are published by the engine thread after steps and commands, at most every
`STATS_INTERVAL_S`, and read without a command (`stats()`): /metrics and `ft top`'s event stream
never wait for a step, a rebuild, or the overlapped step in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from ft.engine.core.admin import EngineAdmin
from ft.engine.core.device_fault import device_fault
from ft.errors import DeviceFailed, FreeTokenError
from ft.server.stats_log import StatsLogger

log = logging.getLogger("ft.server")

STATS_INTERVAL_S = 0.02
"""Least seconds between two published `EngineStats` (a snapshot costs tens of microseconds of the
engine thread; a decode step a few milliseconds): /metrics is at most this much older than the
last step boundary, plus the step running when it is asked."""
VIEW_INTERVAL_S = 0.5
"""Least seconds between two published views (`publish_view`: the admin cache state, ~1 ms to take)."""
VIEW_DEMAND_S = 5.0
"""A view is taken only while a reader asked for it within this many seconds (a dashboard is open)."""


@dataclass
class TokenEvent:
    """One generated token of a request (finish_reason set on its last one). `text` is the text it
    releases (the sequence's `text.delta`): safe to send, the deltas add up to the final text."""

    token_id: int
    num_output: int
    finish_reason: str | None
    stop_text: str | None
    num_cached: int
    text: str = ""
    logprob: Any = None  # its TokenLogprob when the request asked for logprobs
    prompt_logprobs: Any = None  # on the first token, the prompt's (a list, the first None) when asked


class RequestStream:
    """The async end of one request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.loop, self.request_id = loop, request_id
        self.queue: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.finished = False
        self.seq: Any = None  # the engine's Sequence (touched on the engine thread only)

    def push(self, item: TokenEvent | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineLoop:
    """Builds the engine in its thread (state "starting" until it is up), then serves commands."""

    def __init__(self, build: Callable[[], Any], stats_interval_s: float = 0.0) -> None:
        """`stats_interval_s` > 0: a stats line (ft.server.stats_log) every that many seconds of activity."""
        self._build = build
        self._stats = StatsLogger(stats_interval_s) if stats_interval_s > 0 else None
        self._commands: queue.Queue[tuple[Callable[[Any], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._draining = False
        self.engine: Any = None
        self.state = "starting"  # -> "serving" -> "failed" when the device is lost (or "failed" at start)
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.on_failure: Callable[[], None] | None = None  # called once, on this thread, when the device is lost
        self._published: Any = None  # the engine's latest EngineStats (replaced whole: readers need no lock)
        self._published_at = float("-inf")
        self._view_command: tuple[str, tuple] | None = None  # (name, args) of the published view
        self._view: Any = None
        self._view_at = self._view_wanted_at = float("-inf")
        self._view_key: Any = None
        self._reported: set[str] = set()  # failures already logged (`_report_once`)
        self._thread = threading.Thread(target=self._main, name="ft-engine", daemon=True)

    # ------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    @property
    def draining(self) -> bool:
        """Shutdown has begun: no new requests; long-lived streams (`/admin/events`) end."""
        return self._draining

    def begin_drain(self, drain_s: float) -> None:
        """Shutdown, first part (the signal handler's): no new requests from now on; the running ones
        get `drain_s` seconds, then each ends with an `abort` event (a final chunk and [DONE] for a
        stream, finish_reason "abort" for a whole answer), so that no response is cut mid-way."""
        if self._draining:
            return
        self._draining = True

        def watch() -> None:
            deadline = time.monotonic() + drain_s
            while self.engine is not None and self._thread.is_alive() and time.monotonic() < deadline:
                try:
                    if not self.call_sync(lambda e: e.has_work, timeout=5.0):
                        return
                except Exception:  # noqa: BLE001 - the engine thread is gone: nothing to drain
                    return
                time.sleep(0.05)
            if self.engine is not None and self._thread.is_alive():
                try:
                    self.call_sync(self._abort_all, timeout=5.0)
                except Exception:  # noqa: BLE001
                    pass

        threading.Thread(target=watch, name="ft-drain", daemon=True).start()

    def stop(self, drain_s: float = 0.0) -> None:
        """Finish running requests for up to `drain_s` seconds, abort the rest, end the thread."""
        self._draining = True
        deadline = time.monotonic() + drain_s
        while drain_s and self.engine is not None and self.state == "serving" and time.monotonic() < deadline:
            busy = self.call_sync(lambda e: e.has_work, timeout=5.0)
            if not busy:
                break
            time.sleep(0.05)
        if self.engine is not None and self.state == "serving" and self._thread.is_alive():
            try:
                self.call_sync(self._abort_all, timeout=5.0)
            except Exception:  # the thread may already be gone
                pass
        self._stop.set()
        self._thread.join(timeout=10)

    def _main(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as e:  # reported by /health and the serve command
            if not isinstance(e, FreeTokenError):  # a user error is one line (ft serve's); a bug, a traceback
                log.exception("engine failed to start")
            self.error = e
            self.state = "failed"
            self.ready.set()
            return
        self._publish_stats(force=True)
        self.state = "serving"
        if self._stats is not None:
            self._log_stats()  # the baseline: the first interval starts when the engine is up
        self.ready.set()
        while not self._stop.is_set():
            self._run_commands(block=not self.engine.has_work)
            if self.engine.has_work:
                self._step()
            else:
                self._publish_stats()  # idle: the figures and the view stay current
            if self._stats is not None:
                self._log_stats()
        close = getattr(self.engine, "close", None)  # tensor parallelism: the worker ranks leave
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - after a device failure the ranks may be gone already
                log.exception("closing the engine failed")

    def _log_stats(self) -> None:
        try:
            self._stats.tick(self.stats)
        except Exception:  # noqa: BLE001 - a broken stats line must not stop serving: report it once, stop it
            log.exception("the stats line failed; no more stats lines")
            self._stats = None

    def stats(self) -> Any:
        """The engine's latest published `EngineStats` (None before the engine is up): any thread, no
        command, no wait."""
        return self._published

    def publish_view(self, name: str, *args) -> None:
        """Also publish the admin command `name`(*args)'s answer (a heavier view, e.g. "cache_state")
        for `view()`: taken on the engine thread while a reader wants it, at most every
        `VIEW_INTERVAL_S`, and at once when the pools' geometry or the ladder's rung changed (a resize
        shows at the next read)."""
        _check_command(name)
        self._view_command = (name, args)

    def view(self) -> Any:
        """The latest published view (None until one was taken: the first reader asks for one and
        gets None; take it with `command` then). Any thread, no command."""
        self._view_wanted_at = time.monotonic()
        return self._view

    def _publish_stats(self, force: bool = False) -> None:
        """Take and publish `Engine.stats()` (on the engine thread), unless the last one is younger
        than `STATS_INTERVAL_S` and not `force`d; then the view when it is due."""
        now = time.monotonic()
        if not force and now - self._published_at < STATS_INTERVAL_S:
            return
        try:
            self._published = self.engine.stats()
        except Exception:  # noqa: BLE001 - readers keep the last figures; a bug here must not stop serving
            self._report_once("taking the engine's figures failed (readers keep the last ones)")
        self._published_at = now
        if self._view_command is None or now - self._view_wanted_at > VIEW_DEMAND_S:
            return
        st = self._published
        key = (st.moe_slots, st.kv_tokens, st.mamba_slots, st.rung) if st is not None else None
        if key == self._view_key and now - self._view_at < VIEW_INTERVAL_S:
            return
        try:
            name, args = self._view_command
            self._view = getattr(EngineAdmin(self.engine), name)(*args)
        except Exception:  # noqa: BLE001 - as above
            self._report_once("taking the engine's view failed (readers keep the last one)")
        self._view_at, self._view_key = now, key

    def _report_once(self, what: str) -> None:
        """Log the exception being handled with its traceback the first time `what` fails (it may
        fail again every few milliseconds)."""
        if what not in self._reported:
            self._reported.add(what)
            log.exception("%s", what)

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands (waiting up to 50 ms for one when `block`), each followed by the
        figures it changed (`_publish_stats`); whether any ran."""
        try:
            fn, fut = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        drain = getattr(self.engine, "drain", None)  # overlapped decode: the step in flight lands first
        if drain is not None:
            try:
                outs = drain()
                self._publish_stats(force=True)
                self._publish(outs)
            except BaseException as e:  # noqa: BLE001 - as a failed step: fail its requests, keep serving
                self._fail_step(e)
                if self.state == "failed" and fut.set_running_or_notify_cancel():  # the device is lost
                    fut.set_exception(RuntimeError(f"engine is failed: {self.error}"))
                    return False
        while True:
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as e:
                    self._publish_stats(force=True)
                    fut.set_exception(e)
                else:
                    # figures first: a caller that saw its command done reads figures that include it
                    self._publish_stats(force=True)
                    fut.set_result(result)
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except BaseException as e:  # a bug: fail the requests of the failed step, keep the server up
            self._fail_step(e)
            return
        # figures first, tokens second: a client that saw its request end reads figures that count it
        self._publish_stats(force=any(seq.finish_reason for seq in outs))
        self._publish(outs)

    def _fail_step(self, e: BaseException) -> None:
        """A step raised: fail the requests it was running (their state may be half-updated); when the
        error lost the device (`device_fault`), fail everything and stop (`_device_lost`)."""
        reason = device_fault(e)
        if reason is not None:
            self._device_lost(e, reason)
            return
        log.exception("engine step failed")
        work = self.engine.current_work
        self.engine.current_work = None
        # NOTE: only the step's own requests can have half-updated state (KV, linear-attention
        # state); requests waiting outside it go on. Without a known batch, everything fails.
        rids = [s.request_id for s in work.seqs] if work is not None else list(self._streams)
        for rid in rids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.push(RuntimeError(f"the request failed in an engine step ({type(e).__name__}; "
                                         "the server log has the details)"))
            self.engine.abort(rid)

    def _device_lost(self, e: BaseException, reason: str) -> None:
        """The CUDA context is lost: every request fails now (none can run another step), queued
        commands fail, /health answers 503 with the reason (state "failed"), the loop ends and
        `on_failure` tells `ft serve` to exit non-zero. The engine is not touched again."""
        log.error("the GPU failed in an engine step (%s): failing every request; ft serve exits non-zero so "
                  "that a supervisor restarts it", reason, exc_info=e)
        self.error = DeviceFailed(reason)
        self.state = "failed"
        self._stop.set()
        for stream in self._streams.values():
            stream.push(RuntimeError(f"{self.error}; retry once the server has restarted"))
        self._streams.clear()
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"engine is failed: {reason}"))
        if self.on_failure is not None:
            self.on_failure()

    def _publish(self, outs: list) -> None:
        """Each sequence's new token (and its end) to its request's stream."""
        for seq in outs:
            stream = self._streams.get(seq.request_id)
            if stream is None:
                continue
            if seq.finish_reason == "error":
                self._streams.pop(seq.request_id, None)
                stream.push(RuntimeError(seq.error or "the request failed"))
                continue
            stream.push(TokenEvent(seq.output_ids[-1], len(seq.output_ids), seq.finish_reason, seq.stop_text,
                                   seq.num_cached, seq.text.delta, seq.logprobs[-1] if seq.logprobs else None,
                                   seq.prompt_logprobs if len(seq.output_ids) == 1 else None))
            if seq.finish_reason:
                self._streams.pop(seq.request_id, None)

    def _abort_all(self, engine) -> None:
        for rid, stream in list(self._streams.items()):
            tail = stream.seq.text.finish() if stream.seq is not None else ""  # the text held back
            engine.abort(rid)
            stream.push(TokenEvent(-1, 0, "abort", None, 0, tail))
        self._streams.clear()

    # ------------------------------------------------------------------------- commands
    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between two steps."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.state != "serving" or self._stop.is_set():
            fut.set_exception(RuntimeError(f"engine is {self.state}"))
            return fut
        self._commands.put((fn, fut))
        return fut

    def call_sync(self, fn: Callable[[Any], Any], timeout: float | None = None) -> Any:
        return self.call(fn).result(timeout)

    async def acall(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    async def command(self, name: str, *args) -> Any:
        """Run the engine's admin command `name` (`ft.engine.core.admin.EngineAdmin.COMMANDS`) with plain
        data on the engine thread; its answer (plain data or a schema), or its exception."""
        _check_command(name)
        return await self.acall(lambda engine: getattr(EngineAdmin(engine), name)(*args))

    async def submit(self, prompt_ids: list[int], params, request_id: str) -> RequestStream:
        """Queue a request; raises the engine's RequestError when it cannot be served."""
        if self._draining:
            raise RuntimeError("the server is shutting down")
        stream = RequestStream(asyncio.get_running_loop(), request_id)

        def add(engine):
            stream.seq = engine.add_request(prompt_ids, params, request_id=request_id)
            self._streams[request_id] = stream

        await self.acall(add)
        return stream

    async def submit_group(self, prompt_ids: list[int], params_list: list, request_ids: list[str]) -> list[RequestStream]:
        """Queue the n choices of one prompt (`Engine.add_request_group`: one prompt prefill shared
        by all); one stream per choice, in order. Raises the engine's RequestError (none queued)."""
        if self._draining:
            raise RuntimeError("the server is shutting down")
        loop = asyncio.get_running_loop()
        streams = [RequestStream(loop, rid) for rid in request_ids]

        def add(engine):
            seqs = engine.add_request_group(prompt_ids, params_list, request_ids=request_ids)
            for stream, seq in zip(streams, seqs):
                stream.seq = seq
                self._streams[stream.request_id] = stream

        await self.acall(add)
        return streams

    def abort(self, request_id: str) -> None:
        """Cancel a request (fire and forget): its pages and slot are freed at once."""

        def drop(engine):
            self._streams.pop(request_id, None)
            engine.abort(request_id)

        if self.state == "serving":
            self.call(drop)


def _check_command(name: str) -> None:
    if name not in EngineAdmin.COMMANDS:
        raise ValueError(f"no engine command {name!r} (commands: {', '.join(sorted(EngineAdmin.COMMANDS))})")
