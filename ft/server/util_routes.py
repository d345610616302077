"""Utility routes in vLLM's shapes: POST /tokenize, POST /detokenize, GET /version, GET /v1/models/{id}.

/tokenize and /detokenize take the API key like the /v1 routes (the front door, `Guard`, checks it
for every path of `API_KEY_PATHS`) and run the tokenizer in a worker thread (`prompt_prep.off_loop`),
never on the event loop. /version answers without a key, like /health and /metrics (which carry
the same build information in `ft_build_info`). Errors have the server's shape (`ft.server.errors`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

import ft
from ft.server import openai_routes
from ft.schemas import JsonInt
from ft.server.errors import ApiError
from ft.server.openai_protocol import ChatMessage
from ft.server.prompt_prep import encode_prompt, off_loop

router = APIRouter()

API_KEY_PATHS = ("/tokenize", "/detokenize")
"""Paths outside /v1 that need the API key (and a serving engine) like /v1 does."""


class TokenizeRequest(BaseModel):
    """vLLM's two /tokenize bodies in one: `prompt` (a completion prompt, encoded as
    /v1/completions encodes it) or `messages` (a conversation, rendered by the chat template as
    /v1/chat/completions renders it, with `add_generation_prompt`, `tools`, `chat_template_kwargs`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # also answer each token's string (vLLM's `token_strs`)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[JsonInt]


def _state(request: Request):
    return request.app.state.ft


def _check_model(st, model: str | None) -> None:
    """A request may name the model (vLLM's bodies carry it); a wrong name is a 404 as in /v1."""
    if model is not None and model != st.model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{st.model_name}`",
                       "model_not_found")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """{"tokens": [ids], "count": n, "max_model_len": the context limit in tokens} (and "token_strs"
    when asked). Exactly one of `prompt` and `messages`; 400 otherwise, on a bad chat template, or
    on text that is not valid Unicode."""
    from ft.engine.text.tokenizer import ChatTemplateError

    st = _state(request)
    _check_model(st, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "send either `prompt` (a string) or `messages` (a conversation), not both or neither")
    if body.prompt is not None:
        prompt = body.prompt

        def encode() -> list[int]:
            return encode_prompt(st, prompt)
    else:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        kwargs = dict(body.chat_template_kwargs or {})
        add_generation_prompt = kwargs.pop("add_generation_prompt", body.add_generation_prompt)
        if "tools" in kwargs and body.tools is not None:
            raise ApiError(400, "tools given twice: in the request and in chat_template_kwargs")
        tools = kwargs.pop("tools", body.tools)
        if "chat_template" in kwargs and not st.allow_client_chat_template:
            raise ApiError(400, "chat_template_kwargs.chat_template: client chat templates are off on this server "
                           "(ft serve --allow-client-chat-template turns them on)")

        def encode() -> list[int]:
            text = st.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    tools=tools, **kwargs)
            return encode_prompt(st, text)

    try:
        ids = await off_loop(st, encode)
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": st.context_limit}
    if body.return_token_strs:
        out["token_strs"] = [st.tokenizer.id_to_token(t) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    """{"prompt": the text of `tokens`} (special tokens kept, so that /tokenize's ids round-trip).
    Ids outside the tokenizer's vocabulary (0..vocab_size-1) are a 400 that names them (the
    tokenizer would drop them silently)."""
    st = _state(request)
    _check_model(st, body.model)
    tok = st.tokenizer
    vocab = tok.vocab_size
    bad = sorted({t for t in body.tokens if not 0 <= t < vocab})
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        raise ApiError(400, f"token ids outside the vocabulary (0..{vocab - 1}): {shown}")
    tokens = list(body.tokens)
    text = await off_loop(st, lambda: tok.decode(tokens, skip_special_tokens=False))
    return {"prompt": text}


@router.get("/version")
async def version() -> dict:
    """{"version": ft.__version__, "git_rev": the checkout's commit or null, "python", "torch",
    "triton": versions or null}."""
    return build_info()


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    """The model object of /v1/models whose id is `model_id`; 404 (model_not_found) for another id."""
    listing = await openai_routes.models(request)
    for card in listing["data"]:
        if card["id"] == model_id:
            return card
    raise ApiError(404, f"The model `{model_id}` does not exist; this server serves `{_state(request).model_name}`",
                   "model_not_found")


@functools.cache
def build_info() -> dict:
    """What this server runs, read once: ft's version, the git commit of the checkout it runs from
    (None when ft is installed without one), and the versions of Python, torch and triton."""

    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"version": ft.__version__, "git_rev": git_rev(Path(ft.__file__).resolve().parent.parent),
            "python": platform.python_version(), "torch": dist("torch"), "triton": dist("triton")}


def git_rev(root: Path) -> str | None:
    """The commit HEAD names in the git checkout at `root` (40 hex digits), read from its files
    (no git process); None when `root` has no .git or it cannot be read. Follows a worktree's
    `gitdir:` file, loose refs and packed-refs."""
    try:
        git = root / ".git"
        if git.is_file():  # a worktree or submodule: "gitdir: <path>"
            git = (root / git.read_text().strip().removeprefix("gitdir:").strip()).resolve()
        if not git.is_dir():
            return None
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head if _is_sha(head) else None
        ref = head.removeprefix("ref:").strip()
        dirs = [git]
        if (git / "commondir").is_file():
            dirs.append((git / (git / "commondir").read_text().strip()).resolve())
        for d in dirs:
            if (d / ref).is_file():
                sha = (d / ref).read_text().strip()
                return sha if _is_sha(sha) else None
            if (d / "packed-refs").is_file():
                for line in (d / "packed-refs").read_text().splitlines():
                    sha, _, name = line.partition(" ")
                    if name.strip() == ref and _is_sha(sha):
                        return sha
        return None
    except (OSError, UnicodeDecodeError):
        return None


def _is_sha(s: str) -> bool:
    return len(s) in (40, 64) and all(c in "0123456789abcdef" for c in s)
