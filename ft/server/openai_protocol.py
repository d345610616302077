"""OpenAI request bodies FreeToken accepts (validated by pydantic) and response builders."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


# NOTE: strict types: "8" is not a number and true is not 1 (a bool or a numeric string sent where a
# number or a bool belongs is a client bug: 400, never a silent conversion); JSON ints are floats.
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Sampling(BaseModel):
    # Unknown fields are ignored (OpenAI clients send extras such as `user`).
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # an extension (vLLM and SGLang accept it too)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # an extension
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    echo: bool = False


class TextPart(BaseModel):
    """A part of a message's content: FreeToken's models read text only."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_body(rid: str, model: str, text: str, finish: str | None, use: dict | None, created: int | None = None) -> dict:
    body = {
        "id": rid, "object": "text_completion", "created": created or int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }
    if use is not None:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict | None) -> dict:
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                     "logprobs": None}],
        "usage": use,
    }


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    return {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
