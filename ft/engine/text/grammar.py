"""Constrained decoding: a grammar per request (a JSON schema, or a Lark grammar that may embed
JSON schemas) compiled into a matcher over the model's tokenizer; each step the matcher fills the
row's token bitmask (bit t of word t // 32 set: token t allowed), the sampler masks the disallowed
logits with -inf (`ft.engine.sampling.sampler.apply_grammar`), and the sampled token advances the matcher.

The engine is llguidance (guidance-ai, Rust with a Python binding), chosen among the three
maintained ones by checking each here (`pip download --no-deps`, Python 3.11, x86_64):

* llguidance 1.9.1: one abi3 wheel (any CPython >= 3.9), **no Python dependencies**; builds its
  token trie straight from a `tokenizer.json` string (`tokenizers.Tokenizer.to_str()`), so our own
  tokenizer wrapper feeds it without `transformers`; JSON schemas, Lark grammars with `%json`
  embedded schemas (what the tool-call grammar uses), regexes; EOS is allowed exactly where the
  grammar accepts.
* xgrammar 0.2.9: a cp311 wheel, but it requires torch, triton, transformers, pydantic and
  apache-tvm-ffi (transformers is only a test dependency of FreeToken).
* outlines-core 0.2.14: no dependencies either, but JSON schema goes through a regex into a DFA
  index built over the whole vocabulary up front (slow to build for real schemas, no recursion,
  no context-free grammars), and its vocabulary needs the byte-level token strings decoded by the
  caller.

Measured with `bench/grammar_mask.py` on the demo tokenizer (byte-level BPE, 320 tokens; a
3-property object schema walked by random allowed tokens, 2000 tokens, a shared CPU core):
llguidance 5.0 us per token's bitmask (setup 29 ms: token trie + schema), outlines-core 1.4 us
(setup 2.8 ms; it returns a list of ids from an index precomputed per schema over the whole
vocabulary, which is the part that grows with a real 150k vocabulary and a real schema). Both are
negligible next to a decode step; llguidance wins on dependencies, grammar coverage (Lark + JSON,
needed for the tool-call grammar) and a bitmask written in place.

The bitmask is filled on the host (the matchers are host objects), into a pinned staging buffer,
and travels to the logits' device in one small non-blocking copy per step (`GrammarMaskBuffer`).
"""

from __future__ import annotations

import json
import threading
from typing import Iterable

import torch

from ft.errors import RequestError

# A request's grammar, hashable (it lives in the frozen SamplingParams): (kind, text) with kind
# "json_schema" (text: the schema as JSON) or "lark" (a Lark grammar, llguidance's dialect).
GRAMMAR_KINDS = ("json_schema", "lark")


def json_schema_spec(schema) -> tuple[str, str]:
    """The grammar spec of a JSON schema (a dict, or True for any JSON value)."""
    return ("json_schema", json.dumps(schema, sort_keys=True))


def mask_words(vocab: int) -> int:
    """int32 words of a bitmask over `vocab` tokens."""
    return (vocab + 31) // 32


class GrammarMatcher:
    """One sequence's position in its grammar (an llguidance LLMatcher)."""

    def __init__(self, matcher, words: int) -> None:
        self._m = matcher
        self.words = words  # of its bitmask row

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` (a contiguous host int32 tensor [words])."""
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False when the grammar does not allow it (the matcher is
        then in its error state)."""
        return bool(self._m.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete: no further token is allowed (only the end)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Compiles grammar specs into matchers over one tokenizer: `tokenizer_json` is the HF
    `tokenizers` pipeline as a JSON string, `vocab` the model's vocabulary size (the logits' width,
    which may exceed the tokenizer's), `eos_ids` the tokens allowed where the grammar accepts."""

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids: Iterable[int]) -> None:
        import llguidance

        self._ll = llguidance
        eos = sorted(set(int(t) for t in eos_ids))
        self.vocab = vocab
        self.words = mask_words(vocab)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos or None)
        self._cache: dict[tuple[str, str], str] = {}  # spec -> validated grammar (a few recent ones)
        self._lock = threading.Lock()

    def grammar(self, spec: tuple[str, str]) -> str:
        """The validated llguidance grammar of `spec`; RequestError naming the problem."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        kind, text = spec
        ll = self._ll.LLMatcher
        try:
            if kind == "json_schema":
                # NOTE: compact JSON (no free whitespace) unless the schema's x-guidance says otherwise:
                # a model must not be able to pad forever with spaces and newlines
                grammar = ll.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
            elif kind == "lark":
                grammar = ll.grammar_from_lark(text)
            else:
                raise RequestError(f"unknown grammar kind {kind!r} (expected one of {', '.join(GRAMMAR_KINDS)})")
        except ValueError as e:
            raise RequestError(f"invalid {kind.replace('_', ' ')}: {e}") from None
        problem = ll.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise RequestError(f"invalid {kind.replace('_', ' ')}: {problem}")
        with self._lock:
            if len(self._cache) >= 64:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = grammar
        return grammar

    def matcher(self, spec: tuple[str, str]) -> GrammarMatcher:
        m = self._ll.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if m.is_error():
            raise RequestError(f"invalid {spec[0].replace('_', ' ')}: {m.get_error()}")
        return GrammarMatcher(m, self.words)


class GrammarMaskBuffer:
    """The bitmasks [G, words] int32 of a step's grammar rows: filled on the host (pinned on CUDA)
    by the matchers, then one non-blocking copy into a persistent device buffer. The step ends
    with a wait on the device (ModelRunner._wait), so the next step may rewrite the staging."""

    def __init__(self, device: torch.device, rows: int = 1, words: int = 1) -> None:
        self.device = device
        self._alloc(max(1, rows), max(1, words))

    def _alloc(self, rows: int, words: int) -> None:
        self.rows, self.words = rows, words
        self.host = torch.zeros(rows, words, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.device_buffer = torch.zeros(rows, words, dtype=torch.int32, device=self.device)

    def load(self, matchers: list[GrammarMatcher], words: int) -> torch.Tensor:
        """Fill one row per matcher and copy them to the device; returns the device view [G, words]."""
        g = len(matchers)
        if g > self.rows or words != self.words:
            self._alloc(max(g, 2 * self.rows) if g > self.rows else self.rows, words)
        host = self.host[:g]
        for i, m in enumerate(matchers):
            m.fill(host[i])
        out = self.device_buffer[:g]
        out.copy_(host, non_blocking=True)
        return out
