"""OpenAI request bodies FreeToken accepts (validated by pydantic), the fields it refuses, and
response builders.

Fields are implemented, accepted and ignored (HARMLESS), or refused with a 400 whose message names
the field: known OpenAI fields FreeToken does not implement (REFUSED, each with its reason) and any
unknown field. Nothing a client asks for is silently dropped.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from ft.engine.base.sampling_params import MAX_LOGPROBS
from ft.schemas import JsonInt

# NOTE: strict types: "8" is not a number and true is not 1 (a bool or a numeric string sent where a
# number or a bool belongs is a client bug: 400, never a silent conversion); JSON ints are floats, and
# a float with no fraction is an int (`JsonInt`: JSON Schema's "integer" admits 16.0).
STRICT = ConfigDict(strict=True)

HARMLESS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
"""Fields accepted and ignored: they ask nothing of the generation (who the end user is, tags,
OpenAI-side storage of the completion, the billing tier, cache routing and abuse-tracking hints)."""

_TOOLS = "the legacy function-calling fields are not implemented: use tools and tool_choice"

REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # field: (the values that ask for nothing FreeToken lacks, why any other value is refused)
    "functions": (lambda v: v is None or v == [], _TOOLS),
    "function_call": (lambda v: v is None or v == "none", _TOOLS),
    "audio": (lambda v: v is None, "audio output is not supported: FreeToken's models produce text only"),
    "modalities": (lambda v: v is None or v == ["text"], 'only ["text"] is supported: FreeToken\'s models '
                   "produce text only"),
    "prediction": (lambda v: v is None, "predicted outputs are not implemented"),
    "suffix": (lambda v: v is None or v == "", "suffix (text after the insertion point) is not supported"),
    "reasoning_effort": (lambda v: v is None, "reasoning_effort is not implemented (a chat template may take "
                         "its own switch in chat_template_kwargs, e.g. enable_thinking)"),
    "verbosity": (lambda v: v is None, "verbosity is not implemented"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
}


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class SamplingFields(BaseModel):
    # NOTE: extra fields are kept (not ignored) so that `refusal` can name them
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: JsonInt = Field(default=0, ge=0)  # an extension (vLLM and SGLang accept it too)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # an extension (vLLM)
    n: JsonInt = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[JsonInt] | None = None  # an extension (vLLM)
    seed: JsonInt | None = None
    ignore_eos: bool = False  # an extension
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)  # an extension (vLLM, HF)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {name, schema, strict?}}
    response_format: dict[str, Any] | None = None

    def grammar(self) -> tuple[str, str] | None:
        """The grammar spec (ft.engine.text.grammar) that response_format asks for; ValueError naming
        what is wrong with it."""
        fmt = self.response_format
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "text" and len(fmt) == 1:
            return None
        if kind == "json_object" and len(fmt) == 1:
            return ("json_schema", json.dumps({"type": "object"}))
        if kind == "json_schema" and set(fmt) == {"type", "json_schema"}:
            spec = fmt["json_schema"]
            if not isinstance(spec, dict):
                raise ValueError("response_format.json_schema must be an object")
            extra = set(spec) - {"name", "description", "schema", "strict"}
            if extra:
                raise ValueError(f"response_format.json_schema: unknown key(s) {', '.join(sorted(extra))}")
            if not isinstance(spec.get("name"), str):
                raise ValueError("response_format.json_schema.name must be a string")
            if "strict" in spec and not isinstance(spec["strict"], (bool, type(None))):
                raise ValueError("response_format.json_schema.strict must be a boolean")
            schema = spec.get("schema")
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema: a JSON schema (an object) is required")
            return ("json_schema", json.dumps(schema))
        raise ValueError('response_format: expected {"type": "text"}, {"type": "json_object"} or '
                         '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}, '
                         f"got {json.dumps(fmt)[:200]}")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # (an empty one: refused, a 400)

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias); ValueError naming a key that is not a token id."""
        pairs = []
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ValueError(f"logit_bias: the key {key!r} is not a token id") from None
            pairs.append((token, value))
        return tuple(pairs)


# (a plain str to validation, whose before-validator refuses "" with one message: a constrained str
# would also refuse a lone surrogate before the route can say it is not valid Unicode)
NonEmptyText = Annotated[str, WithJsonSchema({"type": "string", "minLength": 1})]
NonEmptyIds = Annotated[list[JsonInt], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    # a string or ids: one prompt; a list of them: several. None may be empty (the schema says so, as
    # validation does: an empty prompt has no token to start from)
    prompt: NonEmptyText | NonEmptyIds | Annotated[list[NonEmptyText], Field(min_length=1)] \
        | Annotated[list[NonEmptyIds], Field(min_length=1)]

    @field_validator("prompt", mode="before")
    @classmethod
    def _not_empty(cls, prompt):
        """One message for every empty form (the schema's four alternatives would each say theirs)."""
        if prompt == "" or prompt == []:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list):
            for i, p in enumerate(prompt):
                if p == "" or p == []:
                    raise ValueError(f"prompt {i} is empty")
        return prompt
    max_tokens: JsonInt | None = 16
    echo: bool = False
    logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: JsonInt | None = Field(default=None, ge=1)


class TextPart(BaseModel):
    """A part of a message's content: FreeToken's models read text only (other types are refused by
    ChatMessage). A text part's other keys (e.g. cache hints) carry nothing for the model."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content):
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part.type != "text":
                raise ValueError(f"content[{j}] is of type {part.type!r}: only text parts are supported "
                                 "(FreeToken's models read text only)")
            if part.text is None:
                raise ValueError(f"content[{j}]: a text part needs `text`")
        return content

    @model_validator(mode="after")
    def _content_unless_assistant(self):
        # (OpenAI's schema: only an assistant message, one that calls tools, may come without content; a user
        # message with none was served as an empty one)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (text or text parts)")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    """A tool the model may call (`tools`): a function with a JSON schema of its arguments."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class _FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: _FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: JsonInt | None = None
    max_completion_tokens: JsonInt | None = None
    logprobs: bool | None = False
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_dicts(self) -> list[dict] | None:
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether a tool call is forced, the function it must call or None for any)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return True, choice.function.name
        return choice == "required", None


def refusal(body: SamplingFields) -> str | None:
    """Why `body` asks for something FreeToken does not implement, naming the field; None if not."""
    for name, value in (body.model_extra or {}).items():
        if name in HARMLESS:
            continue
        if name in REFUSED:
            accepts, why = REFUSED[name]
            if not accepts(value):
                return f"{name}: {why}"
            continue
        return (f"{name}: FreeToken does not implement this field, and refuses what it does not implement "
                f"rather than ignoring it (accepted and ignored: {', '.join(HARMLESS)})")
    if isinstance(body, CompletionRequest) and body.best_of is not None and body.best_of != body.n:
        return f"best_of: only best_of equal to n ({body.n}) is supported: every sequence generated is returned"
    if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
        return "top_logprobs: needs logprobs: true"
    try:
        body.grammar()
    except ValueError as e:
        return str(e)
    if isinstance(body, ChatCompletionRequest):
        forced, name = body.forced_tool()
        if forced and not body.tools:
            return "tool_choice: needs tools"
        if name is not None and name not in {t.function.name for t in body.tools}:
            return f"tool_choice: no tool named {name!r} among the request's tools"
        if forced and body.response_format is not None and body.grammar() is not None:
            return "response_format: cannot be combined with a forced tool_choice (both constrain the output)"
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_body(rid: str, model: str, choices: list[dict], use: dict | None, created: int | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
            "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def chat_choice(index: int, text: str | None, finish: str | None, logprobs: list[dict] | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "finish_reason": finish,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}


def chat_body(rid: str, model: str, choices: list[dict], use: dict | None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model, "choices": choices,
            "usage": use}


def chat_chunk_choice(index: int, delta: dict, finish: str | None, logprobs: list[dict] | None = None) -> dict:
    return {"index": index, "delta": delta, "finish_reason": finish,
            "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None}}


def chat_chunk(rid: str, model: str, created: int, choices: list[dict]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
