"""Driving one request from the asyncio side: submit, receive tokens with their text deltas.

The engine decodes each sequence's text once per token (`ft.engine.text.detokenizer.OutputText`) and
each `TokenEvent` carries the text that token releases: never half a UTF-8 character and, when
stop strings are set, never the last characters that could still start one (the text is cut
before a stop string when it finishes the request). So the emitted text is always a prefix of
the final text, and nothing is decoded here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ft.server.engine_loop import EngineLoop, RequestStream, TokenEvent


class TextStream:
    """The text of one request, added up from its events' deltas (the engine decodes
    incrementally and applies the stop strings)."""

    def __init__(self) -> None:
        self._parts: list[str] = []

    def feed(self, ev: TokenEvent) -> str:
        """The new text that `ev` makes safe to send."""
        if ev.text:
            self._parts.append(ev.text)
        return ev.text

    @property
    def emitted(self) -> str:
        return "".join(self._parts)


@dataclass
class Generation:
    """Outcome of one request (filled in as tokens arrive)."""

    prompt_tokens: int
    started_at: float = field(default_factory=time.perf_counter)
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # a TokenLogprob per token, when the request asked
    prompt_logprobs: list | None = None  # the prompt's (the first None), when the request asked


async def stream_tokens(
    loop: EngineLoop, stream: RequestStream, text: TextStream, gen: Generation, on_token=None
) -> AsyncIterator[str]:
    """Yield text deltas until the request finishes; aborts it if the consumer goes away. With
    logprobs, every token yields (its delta may be ''): its logprob is the last of gen.logprobs."""
    try:
        while True:
            ev = await stream.queue.get()
            if isinstance(ev, BaseException):
                raise ev
            now = time.perf_counter()
            if gen.first_token_at is None:
                gen.first_token_at = now
            if on_token is not None:
                on_token(gen, now)
            gen.token_times.append(now)
            gen.completion_tokens = ev.num_output or gen.completion_tokens
            gen.cached_tokens = ev.num_cached
            delta = text.feed(ev)
            if ev.logprob is not None:
                gen.logprobs.append(ev.logprob)
            if ev.prompt_logprobs is not None:
                gen.prompt_logprobs = ev.prompt_logprobs
            if ev.finish_reason:
                gen.text = text.emitted
                gen.finish_reason = ev.finish_reason
                stream.finished = True
                if delta or ev.logprob is not None:
                    yield delta
                return
            if delta or ev.logprob is not None:  # a token with logprobs is reported even without text yet
                yield delta
    finally:
        gen.text = text.emitted
        if not stream.finished:  # the consumer went away (a disconnect): counted as cancelled
            gen.finish_reason = gen.finish_reason or "cancelled"
            loop.abort(stream.request_id)


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away before its answer (`collect` aborted it)."""


async def collect(loop: EngineLoop, stream: RequestStream, text: TextStream, gen: Generation, is_disconnected, on_token=None) -> Generation:
    """Run a request to the end; abort it and raise ClientDisconnected when the client disconnects
    (an exception, not a cancellation: the route answers it, so the server logs one access line
    instead of an error with a traceback)."""

    async def drain():
        async for _ in stream_tokens(loop, stream, text, gen, on_token):
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                task.result()
                return gen
            if await is_disconnected():
                task.cancel()
                raise ClientDisconnected("client disconnected")
    finally:
        if not task.done():
            task.cancel()
