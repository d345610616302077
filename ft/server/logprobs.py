"""Logprobs in OpenAI's two formats, from the engine's `TokenLogprob`s.

Completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, where each
top_logprobs entry maps token text -> logprob for the asked number of best tokens plus the sampled
one (so up to logprobs + 1 entries, as OpenAI documents); a prompt's first token has null for both.
Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.

A token's text is its bytes decoded as UTF-8; a token whose bytes are not valid UTF-8 on their own
(part of a character) is written "bytes:\\xe2\\x80" (OpenAI's convention), so that two such
tokens never share a key of the legacy top_logprobs. `bytes` (chat) are its exact bytes, which
concatenate to the text's UTF-8. text_offset is the character offset in the returned text where the
token starts (one inside a character: that character's). A logprob of -inf is sent as -9999.0 (JSON
has no infinity), as vLLM does. The logprobs are the model's raw ones (see
`ft.engine.base.sampling_params.SamplingParams`).
"""

from __future__ import annotations

import codecs
import math
from functools import lru_cache
from typing import Iterable

from ft.engine.base.sampling_params import TokenLogprob

FLOOR = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable Latin-1 bytes stand for themselves, the
    other bytes for the characters from U+0100 on, in byte order. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenTexts:
    """Text and bytes of single token ids, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer.backend
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet()
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self.bytes = lru_cache(maxsize=1 << 16)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and self._byte_level and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def text(self, token_id: int) -> str:
        return token_text(self.bytes(token_id))


def token_text(b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


class TextOffsets:
    """Character offsets of successive tokens in the text their bytes decode to."""

    def __init__(self, start: int = 0) -> None:
        self.chars = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def next(self, b: bytes) -> int:
        """The offset where a token of bytes `b` starts (then moves past it)."""
        at = self.chars
        self.chars += len(self._decoder.decode(b))
        return at


def completion_logprobs(entries: Iterable[TokenLogprob], texts: TokenTexts, offsets: TextOffsets | None = None) -> dict:
    """The legacy format of `entries` (a logprob of None: a prompt's first token, see
    `prompt_entries`); `offsets` goes on from earlier chunks of the same text."""
    offsets = offsets or TextOffsets()
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        token = texts.text(e.token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offsets.next(texts.bytes(e.token_id)))
        out["token_logprobs"].append(None if e.logprob is None else _finite(e.logprob))
        if e.logprob is None:
            out["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {}
        for t, lp in e.top:  # NOTE: best first; two tokens with one text keep the better logprob
            top.setdefault(texts.text(t), _finite(lp))
        top.setdefault(token, _finite(e.logprob))
        out["top_logprobs"].append(top)
    return out


def prompt_entries(prompt_ids: list[int], prompt_logprobs: list[TokenLogprob | None]) -> list[TokenLogprob]:
    """The prompt's entries, its first token (no logprob) as TokenLogprob(id, None)."""
    return [e if e is not None else TokenLogprob(t, None) for t, e in zip(prompt_ids, prompt_logprobs)]


def chat_logprobs(entries: Iterable[TokenLogprob], texts: TokenTexts) -> list[dict]:
    """The chat format's `content` list of `entries`."""

    def one(token_id: int, logprob: float) -> dict:
        b = texts.bytes(token_id)
        return {"token": token_text(b), "logprob": _finite(logprob), "bytes": list(b)}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
