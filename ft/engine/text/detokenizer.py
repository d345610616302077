"""Streaming detokenization: generated ids in, text pieces out, never half a UTF-8 character."""

from __future__ import annotations

import os
from typing import Iterable, Sequence

import tokenizers

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # older tokenizers
    _DecodeStream = None


__all__ = ["IncrementalDecoder", "OutputText"]


class IncrementalDecoder:
    """Streaming detokenizer: `step(id)` returns the text that id completes ('' while a UTF-8
    character is still incomplete). The pieces concatenate to `decode(ids)`, once `finish()`'s
    remainder (text of trailing ids that never completed a character) is added.

    `prompt_ids`, when given, is context only: its text is not emitted, but decoders whose output
    depends on what precedes a token (e.g. SentencePiece's leading space) see it.
    Uses `tokenizers.decoders.DecodeStream` when available, else prefix/read offsets.
    """

    _CONTEXT = 6  # prompt ids kept as left context (enough for any merge of bytes into a char)

    def __init__(
        self,
        tokenizer: "Tokenizer | tokenizers.Tokenizer",  # noqa: F821
        prompt_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
        use_decode_stream: bool | None = None,
    ) -> None:
        self._tok = getattr(tokenizer, "backend", tokenizer)  # a ft Tokenizer or a tokenizers.Tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids or ())[-self._CONTEXT:]
        self._ids: list[int] = list(context)
        self._start = len(context)  # ids before this index are prompt context
        self._pending_from = len(context)  # first id not yet reflected in emitted text
        if use_decode_stream is None:
            use_decode_stream = _DecodeStream is not None
        self._stream = None
        if use_decode_stream:
            if _DecodeStream is None:
                raise RuntimeError("tokenizers.decoders.DecodeStream is not available in this version")
            try:
                self._stream = _DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
            except TypeError:  # older versions take no prefill ids
                self._stream = _DecodeStream(skip_special_tokens=skip_special_tokens)
                for i in context:
                    self._stream.step(self._tok, i)
        # offset-based fallback state
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def generated_ids(self) -> list[int]:
        return self._ids[self._start:]

    def step(self, token_id: int) -> str:
        """Feed one generated id; returns the newly completed text (possibly '')."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._stream is not None:
            out = self._stream.step(self._tok, token_id)
            if out is None:
                return ""
            self._pending_from = len(self._ids)
            return out
        return self._step_offsets()

    def _step_offsets(self) -> str:
        ids = self._ids
        prefix = self._tok.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip)
        full = self._tok.decode(ids[self._prefix_offset:], skip_special_tokens=self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            # Decoders may rewrite the prefix's tail (rare); emit what follows the common prefix.
            new = full[len(prefix):] if full.startswith(prefix) else full[len(os.path.commonprefix([full, prefix])):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            self._pending_from = len(ids)
            return new
        return ""

    def feed(self, token_ids: Iterable[int]) -> str:
        """Feed several ids; returns the text they complete."""
        return "".join(self.step(i) for i in token_ids)

    def finish(self) -> str:
        """Text still held back (trailing ids that never completed a UTF-8 character, decoded
        with replacement characters, as `decode()` would). Call once at the end of the stream."""
        if self._pending_from >= len(self._ids):
            return ""
        lo = max(0, self._pending_from - self._CONTEXT)
        ctx = self._tok.decode(self._ids[lo:self._pending_from], skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids[lo:], skip_special_tokens=self._skip)
        self._pending_from = len(self._ids)
        self._prefix_offset = self._read_offset = len(self._ids)
        if full.startswith(ctx):
            return full[len(ctx):]
        return full[len(os.path.commonprefix([full, ctx])):]


class OutputText:
    """The text of one sequence's generated tokens, decoded once per token (O(1) amortised).

    Text is *released* once it is final: never half a UTF-8 character and, with stop strings, never
    the last `max(len(stop)) - 1` characters, which a later token could still turn into the start
    of a stop string (the request's text is cut before it). `delta` is what the last token
    released (with `cut`/`finish`, what they released too); the released pieces concatenate to
    the final text: `stop_text` when a stop string ended it, else `decode(ids)`.

    The engine calls `step(id)` once per token, then, when the request ends, `cut()` (a stop
    string, found by `step`) or `finish()` (any other reason, or an abort).
    """

    def __init__(self, decoder: IncrementalDecoder, stops: Sequence[str] = ()) -> None:
        self._decoder = decoder
        self._stops = tuple(stops)
        self._hold = max(0, max((len(s) for s in self._stops), default=0) - 1)
        self._parts: list[str] = []  # released text
        self._pending = ""  # decoded, not released: the last `_hold` characters (or all, at a stop)
        self._stop_at: int | None = None  # index in _pending of the first stop string found
        self.delta = ""
        self.done = False

    @property
    def text(self) -> str:
        """The text so far (released and held; without an incomplete trailing character)."""
        return "".join(self._parts) + self._pending

    @property
    def stop_found(self) -> bool:
        return self._stop_at is not None

    def step(self, token_id: int) -> str:
        """Feed one generated token; returns (and sets `delta` to) the text it releases. When a stop
        string appears, nothing more is released until `cut()` or `finish()`."""
        self.delta = ""
        if self.done:
            raise RuntimeError("the text is finished")
        buf = self._pending + self._decoder.step(token_id)
        # NOTE: the text before _pending held no stop string at the last step, so one that
        # appears now starts in the held tail or in the new text: searching buf is enough.
        self._stop_at = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=None)
        keep = len(buf) if self._stop_at is not None else min(self._hold, len(buf))
        self._pending = buf[len(buf) - keep:]
        return self._release(buf[: len(buf) - keep])

    def cut(self) -> str:
        """End before the first stop string `step` found; returns the whole text (stop_text)."""
        if self._stop_at is None:
            raise RuntimeError("no stop string was found")
        self._release(self._pending[: self._stop_at])
        self._pending, self.done = "", True
        return "".join(self._parts)

    def finish(self) -> str:
        """End without a cut: release all held text, trailing bytes that never completed a
        character decoded as `decode()` shows them. Returns what it released."""
        if self.done:
            return ""
        out = self._release(self._pending + self._decoder.finish())
        self._pending, self.done = "", True
        return out

    def _release(self, piece: str) -> str:
        if piece:
            self._parts.append(piece)
            self.delta += piece
        return piece
