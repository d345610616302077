"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio

import json
import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ft.server.errors import ApiError
from ft.server.generation import Generation, TextStream, collect, stream_tokens
from ft.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _Sampling,
    chat_body,
    chat_chunk,
    completion_body,
    new_id,
    usage,
)

router = APIRouter()


def _state(request: Request):
    return request.app.state.ft


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


@router.get("/v1/models")
async def models(request: Request) -> dict:
    st = _state(request)
    return {"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": int(st.started_at), "owned_by": "freetoken",
        "max_model_len": st.servable_context,  # what a request sent now can reach (after KV shrinks too)
    }]}


def _check_common(st, body: _Sampling) -> None:
    if body.model != st.model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{st.model_name}`",
                       "model_not_found")
    if body.n != 1:
        raise ApiError(400, "n must be 1: FreeToken returns one choice per request")
    if body.logprobs not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported")
    if body.presence_penalty or body.frequency_penalty:
        raise ApiError(400, "presence_penalty and frequency_penalty are not supported")


def _params(st, body: _Sampling, prompt_len: int, max_tokens: int | None):
    from ft.engine.sampling_params import SamplingParams

    limit = st.servable_context
    if prompt_len >= limit:
        raise ApiError(400, f"the prompt is {prompt_len} tokens; {st.context_reason(limit)}", "context_length_exceeded")
    if max_tokens is not None:
        if max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}")
        if prompt_len + max_tokens > limit:
            why = "" if limit >= st.context_limit else f" Now: {st.context_reason(limit)}."
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion).{why}",
                "context_length_exceeded",
            )
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
        seed=body.seed, stop=body.stop_strings(), ignore_eos=body.ignore_eos,
    )


async def _collect(st, stream, text, gen, request) -> None:
    """Run a non-streaming request to its end; an engine-side failure becomes a 503."""
    try:
        await collect(st.loop, stream, text, gen, request.is_disconnected, st.metrics.on_token)
    except RuntimeError as e:
        raise ApiError(503, f"the request failed: {e}", "server_error") from None
    finally:
        st.metrics.request_finished(gen)


async def _start(st, prompt_ids: list[int], params, rid: str):
    from ft.errors import RequestError

    try:
        return await st.loop.submit(prompt_ids, params, rid)
    except RequestError as e:
        raise ApiError(400, str(e)) from None
    except RuntimeError as e:
        raise ApiError(503, str(e), "server_unavailable", headers={"Retry-After": "5"}) from None


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    st = _state(request)
    _check_common(st, body)
    if body.echo:
        raise ApiError(400, "echo is not supported")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "send one prompt per request (a list of one string or of token ids)")
        prompt = prompt[0]
    ids = await _off_loop(st, _encode, st, prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty")
    params = _params(st, body, len(ids), body.max_tokens)
    return await _respond(st, request, body, ids, params, _CompletionShape(new_id("cmpl"), st.model_name))


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    from ft.engine.tokenizer import ChatTemplateError

    st = _state(request)
    _check_common(st, body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    kwargs = dict(body.chat_template_kwargs or {})
    # the template's own arguments may come in chat_template_kwargs (as vLLM takes them), once
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    if "tools" in kwargs and body.tools is not None:
        raise ApiError(400, "tools given twice: in the request and in chat_template_kwargs")
    tools = kwargs.pop("tools", body.tools)
    if "chat_template" in kwargs and not st.allow_client_chat_template:
        raise ApiError(400, "chat_template_kwargs.chat_template: client chat templates are off on this server "
                       "(ft serve --allow-client-chat-template turns them on)")

    def render_and_encode() -> list[int]:
        prompt = st.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                                  **kwargs)
        return _encode(st, prompt)

    try:
        ids = await _off_loop(st, render_and_encode)
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _params(st, body, len(ids), max_tokens)
    return await _respond(st, request, body, ids, params, _ChatShape(new_id("chatcmpl"), st.model_name))


async def _off_loop(st, fn, *args):
    """fn(*args) in a worker thread, so that the event loop keeps answering (/health, streams) while a
    long prompt is tokenized or a chat template renders; 400 after `st.prompt_timeout_s` (the thread
    cannot be stopped: it finishes in the background, its result unused)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), st.prompt_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(400, f"preparing the prompt (chat template, tokenization) took over {st.prompt_timeout_s:g} s; "
                       "send a shorter prompt") from None


def _encode(st, text: str) -> list[int]:
    """Token ids of a prompt; text that is not valid Unicode (a lone surrogate) is a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the prompt is not valid Unicode: {e.reason} at character {e.start}") from None
    return st.tokenizer.encode(text)


class _CompletionShape:
    """Bodies of /v1/completions: the whole answer, and the stream's chunks."""

    opening = None

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())

    def full(self, gen: Generation, use: dict) -> dict:
        return completion_body(self.rid, self.model, gen.text, gen.finish_reason, use)

    def chunk(self, delta: str | None, finish: str | None, use: dict | None = None) -> dict:
        body = completion_body(self.rid, self.model, delta or "", finish, use, self.created)
        if use is not None:
            body["choices"] = []
        return body


class _ChatShape(_CompletionShape):
    """Bodies of /v1/chat/completions (the stream opens with the assistant role)."""

    opening = {"role": "assistant", "content": ""}

    def full(self, gen: Generation, use: dict) -> dict:
        return chat_body(self.rid, self.model, gen.text, gen.finish_reason, use)

    def chunk(self, delta: str | None, finish: str | None, use: dict | None = None) -> dict:
        body = chat_chunk(self.rid, self.model, self.created, {} if delta is None else {"content": delta}, finish)
        if use is not None:
            body["choices"], body["usage"] = [], use
        return body


async def _respond(st, request: Request, body: _Sampling, ids: list[int], params, shape: _CompletionShape):
    """Run one request and answer it whole or as server-sent events."""
    gen = Generation(prompt_tokens=len(ids))
    stream = await _start(st, ids, params, shape.rid)
    text = TextStream()
    st.metrics.request_started()
    if not body.stream:
        await _collect(st, stream, text, gen, request)
        return shape.full(gen, usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        try:
            if shape.opening is not None:
                chunk = shape.chunk(None, None)
                chunk["choices"][0]["delta"] = dict(shape.opening)
                yield sse(chunk)
            try:
                async for delta in stream_tokens(st.loop, stream, text, gen, st.metrics.on_token):
                    yield sse(shape.chunk(delta, None))
            except RuntimeError as e:
                yield sse({"error": {"message": str(e), "type": "server_error", "code": 503}})
                yield sse("[DONE]")
                return
            yield sse(shape.chunk(None, gen.finish_reason))
            if include_usage:
                yield sse(shape.chunk(None, None, usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)))
            yield sse("[DONE]")
        finally:
            st.metrics.request_finished(gen)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
