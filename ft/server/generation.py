"""Driving one request from the asyncio side: submit, receive tokens, turn them into text deltas.

`TextStream` keeps the emitted text a prefix of the final text: it holds back an incomplete
UTF-8 character and, when stop strings are set, the last characters that could still start
one (the engine cuts the text before a stop string when it finishes the request).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ft.server.engine_loop import EngineLoop, RequestStream, TokenEvent


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.emitted = ""

    def feed(self, ev: TokenEvent) -> str:
        """The new text that `ev` makes safe to send."""
        if ev.token_id >= 0:
            self.ids.append(ev.token_id)
        if ev.finish_reason:
            final = ev.stop_text if ev.stop_text is not None else self.tokenizer.decode(self.ids)
            return self._advance(final, final=True)
        full = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        return self._advance(full[: max(0, len(full) - self.hold)])

    def _advance(self, text: str, final: bool = False) -> str:
        if text.startswith(self.emitted) and len(text) >= len(self.emitted):
            delta = text[len(self.emitted):]
            self.emitted = text
            return delta
        if final:  # the decoder rewrote its tail (rare): send what follows the common part
            delta = text[len(self.emitted):]
            self.emitted = text
            return delta
        return ""


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


async def stream_tokens(
    loop: EngineLoop, stream: RequestStream, text: TextStream, gen: Generation, on_token=None
) -> AsyncIterator[str]:
    """Yield text deltas until the request finishes; aborts it if the consumer goes away."""
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
            gen.text = text.emitted
            if ev.finish_reason:
                gen.finish_reason = ev.finish_reason
                stream.finished = True
                if delta:
                    yield delta
                return
            if delta:
                yield delta
    finally:
        if not stream.finished:
            loop.abort(stream.request_id)


async def collect(loop: EngineLoop, stream: RequestStream, text: TextStream, gen: Generation, is_disconnected, on_token=None) -> Generation:
    """Run a request to the end; abort it when the client disconnects."""

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
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()
