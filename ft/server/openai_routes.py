"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from ft.server.closing_stream import ClosingStreamingResponse

from ft.server.errors import ApiError
from ft.server.prompt_prep import encode_prompt, off_loop
from ft.server.generation import ClientDisconnected, Generation, TextStream, collect, stream_tokens
from ft.server.logprobs import TextOffsets, TokenTexts, chat_logprobs, completion_logprobs, prompt_entries
from ft.server.tool_calls import ToolCallStream, parse_tool_calls, tool_call_grammar
from ft.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    chat_body,
    chat_chunk,
    chat_chunk_choice,
    chat_choice,
    completion_body,
    completion_choice,
    new_id,
    refusal,
    usage,
)

router = APIRouter()

MAX_CHOICES = 128
"""Choices (prompts x n) one request may ask for: each is an engine sequence, admitted like a request
of its own."""


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


def _check_model(st, body: SamplingFields) -> None:
    if body.model != st.model_name:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{st.model_name}`",
                       "model_not_found")


def _check_common(st, body: SamplingFields) -> None:
    """The model is this server's, and the body asks for nothing FreeToken lacks (400 naming the field)."""
    _check_model(st, body)
    why = refusal(body)
    if why is not None:
        raise ApiError(400, why)


def _params(st, body: SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None = None,
            prompt_logprobs: int | None = None, allow_zero: bool = False, grammar: tuple[str, str] | None = None,
            max_tokens_field: str = "max_tokens", zero_note: str = "") -> list:
    """The SamplingParams of each of the body's n choices (seeds seed, seed + 1, ...; unseeded
    choices get random seeds of their own). max_tokens 0 (allow_zero: echo) runs one token, which
    the route drops. `max_tokens_field`: the request's name of max_tokens, for the refusal's text, which ends
    with `zero_note` (where 0 would be allowed otherwise)."""
    from ft.engine.base.sampling_params import SamplingParams
    from ft.errors import RequestError

    limit = st.servable_context
    if prompt_len >= limit:
        raise ApiError(400, f"the prompt is {prompt_len} tokens; {st.context_reason(limit)}", "context_length_exceeded")
    if max_tokens is not None:
        if max_tokens < (0 if allow_zero else 1):
            raise ApiError(400, f"{max_tokens_field} must be at least {0 if allow_zero else 1}, got {max_tokens}"
                           + zero_note)
        if prompt_len + max_tokens > limit:
            why = "" if limit >= st.context_limit else f" Now: {st.context_reason(limit)}."
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion).{why}",
                "context_length_exceeded",
            )
    try:
        bias = body.bias_pairs()
        params = SamplingParams(
            max_new_tokens=max(1, max_tokens) if max_tokens is not None else None, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop_strings(),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=body.repetition_penalty, logit_bias=bias, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, grammar=grammar if grammar is not None else body.grammar(),
        )
    except (ValueError, RequestError) as e:
        raise ApiError(400, str(e)) from None
    if body.seed is None:
        return [params] * body.n
    return [dataclasses.replace(params, seed=body.seed + i) for i in range(body.n)]


CLIENT_CLOSED = 499
"""The status a non-streaming request gets when its client left first (nginx's convention)."""


async def _collect(st, stream, text, gen, request) -> None:
    """Run a non-streaming request to its end; an engine-side failure becomes a 503."""
    try:
        await collect(st.loop, stream, text, gen, request.is_disconnected, st.metrics.on_token)
    except ClientDisconnected:
        gen.finish_reason = "cancelled"
        # nginx's "client closed request": nobody reads it, but the access log gets its line
        raise ApiError(CLIENT_CLOSED, "the client closed the connection before the answer", "client_closed") from None
    except RuntimeError as e:
        gen.finish_reason = "error"  # counted apart from aborts and cancels in /metrics
        raise ApiError(503, f"the request failed: {e}", "server_error") from None
    finally:
        st.metrics.request_finished(gen, stream.seq)


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
    prompt = body.prompt
    # a list of prompts (strings or token-id lists): choice index = prompt index * n + j, as vLLM does
    prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={body.n} = {len(prompts) * body.n} choices; at most "
                       f"{MAX_CHOICES} per request")
    echo = body.echo
    groups, echoes = [], []
    for i, p in enumerate(prompts):
        ids = await off_loop(st, encode_prompt, st, p) if isinstance(p, str) else list(p)
        if not ids:
            raise ApiError(400, "the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty")
        # echo + logprobs: the prompt's logprobs too (its prefill computes every position's logits)
        groups.append((ids, _params(st, body, len(ids), body.max_tokens, logprobs=body.logprobs,
                                    prompt_logprobs=body.logprobs if echo else None, allow_zero=echo,
                                    zero_note="" if echo else " (0 only with echo)")))
        if echo:
            echoes.append(p if isinstance(p, str) else await off_loop(
                st, lambda ids=ids: st.tokenizer.decode(ids, skip_special_tokens=False)))
        else:
            echoes.append(None)
    shape = _CompletionShape(new_id("cmpl"), st.model_name, _texts(st.tokenizer), body.logprobs, echoes,
                             [ids for ids, _ in groups], drop_output=body.max_tokens == 0, n=body.n)
    return await _respond(st, request, body, groups, shape)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    from ft.engine.text.tokenizer import ChatTemplateError

    st = _state(request)
    _check_model(st, body)
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    kwargs = dict(body.chat_template_kwargs or {})
    # the template's own arguments may come in chat_template_kwargs (as vLLM takes them), once
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    if "tools" in kwargs and body.tools is not None:
        raise ApiError(400, "tools given twice: in the request and in chat_template_kwargs")
    _check_common(st, body)
    # `tools` reach the chat template (as Hugging Face's apply_chat_template passes them)
    tools = body.tool_dicts() if body.tools is not None else kwargs.pop("tools", None)
    grammar = None
    forced, name = body.forced_tool()
    if forced:  # tool_choice "required" or a named function: the grammar forces tool-call blocks
        grammar = ("lark", tool_call_grammar(body.tool_dicts(), name, parallel=body.parallel_tool_calls is not False))
    parse_tools = bool(body.tools) and body.tool_choice != "none"
    if "chat_template" in kwargs and not st.allow_client_chat_template:
        raise ApiError(400, "chat_template_kwargs.chat_template: client chat templates are off on this server "
                       "(ft serve --allow-client-chat-template turns them on)")

    def render_and_encode() -> list[int]:
        prompt = st.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                                  **kwargs)
        return encode_prompt(st, prompt)

    try:
        ids = await off_loop(st, render_and_encode)
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    newer, older = body.max_completion_tokens, body.max_tokens
    if newer is not None and older is not None and newer != older:
        raise ApiError(400, f"max_completion_tokens ({newer}) and max_tokens ({older}) differ: give one (max_tokens is "
                       "its older name)")
    field = "max_completion_tokens" if newer is not None else "max_tokens"
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(st, body, len(ids), newer if newer is not None else older, logprobs=top, grammar=grammar,
                     max_tokens_field=field)
    return await _respond(st, request, body, [(ids, params)], _ChatShape(new_id("chatcmpl"), st.model_name,
                                                                        _texts(st.tokenizer), top, parse_tools=parse_tools))


@functools.lru_cache(maxsize=4)
def _texts(tokenizer) -> TokenTexts:
    """Token texts for logprobs, one cache per tokenizer."""
    return TokenTexts(tokenizer)


class _Choice:
    """One choice of a request: its engine stream, its text and Generation, and how far the
    stream has been sent (logprobs taken, text offsets of the legacy format)."""

    def __init__(self, index: int, stream, gen: Generation) -> None:
        self.index, self.stream, self.gen = index, stream, gen
        self.text = TextStream()
        self.taken = 0  # gen.logprobs taken for chunks so far
        self.offsets = TextOffsets()  # the legacy format's text offsets, across chunks
        self.opened = False
        self.tools = ToolCallStream()  # chat with tools: the stream's tool-call blocks

    def take(self) -> list:
        """The logprobs that arrived since the last call."""
        new = self.gen.logprobs[self.taken:]
        self.taken += len(new)
        return new


class _CompletionShape:
    """Bodies of /v1/completions: the whole answer, and the stream's chunks. echo_text: the prompt's
    text when echoed (its logprobs come too when logprobs are asked); drop_output: max_tokens 0 (the
    one token run for the prompt's logprobs is not returned)."""

    eager_opening = False

    def __init__(self, rid: str, model: str, texts: TokenTexts, logprobs: int | None,
                 echo_texts: list[str | None] = (), prompts: list[list[int]] = (), drop_output: bool = False,
                 n: int = 1) -> None:
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.texts, self.logprobs, self.echo_texts, self.prompts = texts, logprobs, list(echo_texts), list(prompts)
        self.drop, self.n = drop_output, n

    def _echo(self, c: _Choice) -> str | None:
        """The echoed prompt text of choice c (prompt c.index // n), or None without echo."""
        return self.echo_texts[c.index // self.n] if self.echo_texts else None

    def _prompt_entries(self, c: _Choice) -> list:
        ids = self.prompts[c.index // self.n]
        return prompt_entries(ids, c.gen.prompt_logprobs or [None] * len(ids))

    def _finish(self, gen: Generation) -> str | None:
        return "length" if self.drop and gen.finish_reason in ("stop", "length") else gen.finish_reason

    def completion_tokens(self, gen: Generation) -> int:
        return 0 if self.drop else gen.completion_tokens

    def full(self, choices: list[_Choice], use: dict) -> dict:
        out = []
        for c in choices:
            text, entries = ("", []) if self.drop else (c.gen.text, list(c.gen.logprobs))
            echo = self._echo(c)
            if echo is not None:
                text = echo + text
                entries = self._prompt_entries(c) + entries if self.logprobs is not None else entries
            lp = completion_logprobs(entries, self.texts) if self.logprobs is not None else None
            out.append(completion_choice(c.index, text, self._finish(c.gen), lp))
        return completion_body(self.rid, self.model, out, use)

    def _chunk(self, choice: dict, use: dict | None = None) -> dict:
        return completion_body(self.rid, self.model, [choice], use, self.created)

    def _legacy(self, c: _Choice, entries: list) -> dict | None:
        if self.logprobs is None:
            return None
        return completion_logprobs(entries, self.texts, c.offsets)

    def opening(self, c: _Choice) -> dict | None:
        echo = self._echo(c)
        if echo is None:
            return None
        return self._chunk(completion_choice(c.index, echo, None, self._legacy(c, self._prompt_entries(c))))

    def delta(self, c: _Choice, delta: str, entries: list) -> dict | None:
        if self.drop:
            return None
        return self._chunk(completion_choice(c.index, delta, None, self._legacy(c, entries)))

    def final(self, c: _Choice) -> dict:
        return self._chunk(completion_choice(c.index, "", self._finish(c.gen)))

    def usage_chunk(self, use: dict) -> dict:
        body = self._chunk({}, use)
        body["choices"] = []
        return body


class _ChatShape(_CompletionShape):
    """Bodies of /v1/chat/completions (each choice's stream opens with the assistant role).
    logprobs: None, or the top_logprobs asked (0..20) when logprobs is true. parse_tools: the
    request has tools (and tool_choice is not "none"): tool-call blocks of the reply become
    `tool_calls` (finish_reason "tool_calls"), streamed as each block completes."""

    eager_opening = True

    def __init__(self, *args, parse_tools: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.parse_tools = parse_tools

    @staticmethod
    def _finish_of(finish: str | None, calls) -> str | None:
        return "tool_calls" if calls and finish == "stop" else finish

    def full(self, choices: list[_Choice], use: dict) -> dict:
        out = []
        for c in choices:
            text, calls = parse_tool_calls(c.gen.text) if self.parse_tools else (c.gen.text, [])
            out.append(chat_choice(c.index, text, self._finish_of(c.gen.finish_reason, calls),
                                   None if self.logprobs is None else chat_logprobs(c.gen.logprobs, self.texts),
                                   calls))
        return chat_body(self.rid, self.model, out, use)

    def _chunk(self, choice: dict, use: dict | None = None) -> dict:
        body = chat_chunk(self.rid, self.model, self.created, [choice])
        if use is not None:
            body["choices"], body["usage"] = [], use
        return body

    def opening(self, c: _Choice) -> dict:
        return self._chunk(chat_chunk_choice(c.index, {"role": "assistant", "content": ""}, None))

    def delta(self, c: _Choice, delta: str, entries: list) -> dict | list[dict]:
        lp = None if self.logprobs is None else chat_logprobs(entries, self.texts)
        if not self.parse_tools:
            return self._chunk(chat_chunk_choice(c.index, {"content": delta}, None, lp))
        chunks = self._tool_chunks(c, c.tools.feed(delta))
        if lp is not None:  # the token's logprobs ride on its first chunk (an empty one when it released none)
            if not chunks:
                chunks = [self._chunk(chat_chunk_choice(c.index, {"content": ""}, None, lp))]
            else:
                chunks[0]["choices"][0]["logprobs"] = {"content": lp, "refusal": None}
        return chunks

    def _tool_chunks(self, c: _Choice, events: list) -> list[dict]:
        return [self._chunk(chat_chunk_choice(c.index, {"content": value} if kind == "content" else
                                              {"tool_calls": [value]}, None)) for kind, value in events]

    def final(self, c: _Choice) -> dict | list[dict]:
        if not self.parse_tools:
            return self._chunk(chat_chunk_choice(c.index, {}, c.gen.finish_reason))
        rest = self._tool_chunks(c, c.tools.finish())
        return rest + [self._chunk(chat_chunk_choice(c.index, {}, self._finish_of(c.gen.finish_reason, c.tools.calls)))]

    def usage_chunk(self, use: dict) -> dict:
        return self._chunk({}, use)


async def _respond(st, request: Request, body: SamplingFields, groups: list[tuple[list[int], list]],
                   shape: _CompletionShape):
    """Run a request's choices and answer them whole or as server-sent events (the choices' chunks
    interleaved, each with its index). groups: per prompt, (its token ids, the SamplingParams of its
    n choices); choice index = prompt index * n + j, one engine sequence each."""
    choices: list[_Choice] = []
    total = sum(len(params) for _, params in groups)
    try:
        for ids, params in groups:
            first = len(choices)
            rids = [shape.rid if total == 1 else f"{shape.rid}-{first + j}" for j in range(len(params))]
            gens = [Generation(prompt_tokens=len(ids)) for _ in params]  # before the submit: TTFT and e2e count the engine's queue
            if len(params) == 1:
                streams = [await _start(st, ids, params[0], rids[0])]
            else:  # n choices of one prompt: one shared prompt prefill (Engine.add_request_group)
                from ft.errors import RequestError

                try:
                    streams = await st.loop.submit_group(ids, list(params), rids)
                except RequestError as e:
                    raise ApiError(400, str(e)) from None
                except RuntimeError as e:
                    raise ApiError(503, str(e), "server_unavailable", headers={"Retry-After": "5"}) from None
            for j, (stream, gen) in enumerate(zip(streams, gens)):
                choices.append(_Choice(first + j, stream, gen))
                st.metrics.request_started()
    except BaseException:
        for c in choices:  # the choices already submitted end with the request
            st.loop.abort(c.stream.request_id)
            c.gen.finish_reason = "cancelled"
            st.metrics.request_finished(c.gen, c.stream.seq)
        raise

    firsts = [choices[sum(len(p) for _, p in groups[:g])] for g in range(len(groups))]  # each prompt's first choice

    def use() -> dict:
        # each prompt counted once, whatever n (as vLLM reports it)
        return usage(sum(len(ids) for ids, _ in groups), sum(shape.completion_tokens(c.gen) for c in choices),
                     sum(c.gen.cached_tokens for c in firsts))

    if not body.stream:
        tasks = [asyncio.ensure_future(_collect(st, c.stream, c.text, c.gen, request)) for c in choices]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:  # NOTE: one failed or the client left: the others end too (and abort)
                t.cancel()
        return shape.full(choices, use())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: _Choice) -> None:
            try:
                async for delta in stream_tokens(st.loop, c.stream, c.text, c.gen, st.metrics.on_token):
                    queue.put_nowait((c, delta, c.take()))
                rest = c.take()  # NOTE: none by construction (every token with logprobs yields); never lost
                if rest:
                    queue.put_nowait((c, "", rest))
                queue.put_nowait((c, None, None))
            except RuntimeError as e:
                c.gen.finish_reason = "error"  # counted apart from aborts and cancels in /metrics
                queue.put_nowait((c, None, e))

        tasks = []
        try:
            for c in choices:
                if shape.eager_opening:
                    c.opened = True
                    yield sse(shape.opening(c))
            tasks = [asyncio.ensure_future(pump(c)) for c in choices]
            live = len(choices)
            while live:
                c, delta, extra = await queue.get()
                if isinstance(extra, BaseException):
                    yield sse({"error": {"message": str(extra), "type": "server_error", "code": 503}})
                    yield sse("[DONE]")
                    return
                if not c.opened:
                    c.opened = True
                    opening = shape.opening(c)
                    if opening is not None:
                        yield sse(opening)
                if delta is None:
                    live -= 1
                    for chunk in _chunks(shape.final(c)):
                        yield sse(chunk)
                    continue
                for chunk in _chunks(shape.delta(c, delta, extra)):
                    yield sse(chunk)
            if include_usage:
                yield sse(shape.usage_chunk(use()))
            yield sse("[DONE]")
        finally:
            for t in tasks:  # NOTE: a disconnect or an error: the choices still running are aborted
                t.cancel()
            for c in choices:
                if not c.stream.finished:  # NOTE: the client left, maybe before any pump ran (during the openings)
                    st.loop.abort(c.stream.request_id)
                    c.gen.finish_reason = c.gen.finish_reason or "cancelled"
                st.metrics.request_finished(c.gen, c.stream.seq)

    return ClosingStreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _chunks(out) -> list[dict]:
    """A shape's answer for one event: no chunk (None), one, or several."""
    return [] if out is None else out if isinstance(out, list) else [out]
