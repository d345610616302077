"""Preparing a prompt off the event loop: the routes that tokenize (`openai_routes`, `util_routes`)
share these."""

from __future__ import annotations

import asyncio

from ft.server.errors import ApiError

__all__ = ["encode_prompt", "off_loop"]


async def off_loop(st, fn, *args):
    """fn(*args) in a worker thread, so that the event loop keeps answering (/health, streams) while a
    long prompt is tokenized or a chat template renders; 400 after `st.prompt_timeout_s` (the thread
    cannot be stopped: it finishes in the background, its result unused)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), st.prompt_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(400, f"preparing the prompt (chat template, tokenization) took over {st.prompt_timeout_s:g} s; "
                       "send a shorter prompt") from None


def encode_prompt(st, text: str) -> list[int]:
    """Token ids of a prompt; text that is not valid Unicode (a lone surrogate) is a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the prompt is not valid Unicode: {e.reason} at character {e.start}") from None
    return st.tokenizer.encode(text)
