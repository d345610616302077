"""A request's `Sequence`, built after checking that it can ever be served.

The engine's front door: a prompt and its `SamplingParams` become a `Sequence` (its stop ids, its
token budget within the context that can be served, its seed, its grammar matcher and its text
decoder), or a `RequestError` that says why not, before anything is queued.
"""

from __future__ import annotations

from typing import Callable

import torch

from ft.engine.text.detokenizer import OutputText
from ft.engine.base.sampling_params import SamplingParams
from ft.engine.base.sequence import Sequence
from ft.errors import RequestError

__all__ = ["RequestBuilder"]


class RequestBuilder:
    """`build` for one model: its vocabulary and EOS ids (`model_config`) and its tokenizer. (It holds
    nothing of the engine: an engine that is dropped frees its pools at once, without a cycle.)"""

    def __init__(self, model_config, tokenizer) -> None:
        self.model_config, self.tokenizer = model_config, tokenizer
        self._grammars = None  # the grammar compiler, built on first use (its token trie)
        self._grammars_refused: RequestError | None = None  # why it cannot be built, once tried

    def build(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None, limit: int,
              context_reason: Callable[[int], str]) -> Sequence:
        """A request's Sequence after checking it can ever be served (RequestError otherwise): `limit`
        is the context a request admitted now can reach, `context_reason(limit)` says what caps it."""
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        for what, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"{what}: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        if n >= limit:
            raise RequestError(f"the prompt is {n} tokens; {context_reason(limit)} "
                               "(the prompt plus at least one new token must fit)")
        room = limit - n
        max_new = room if params.max_new_tokens is None else min(params.max_new_tokens, room)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        seq = Sequence(list(map(int, prompt_ids)), params, max_new, frozenset(stop_ids),
                       open_ended=params.max_new_tokens is None)
        if request_id:
            seq.request_id = request_id
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * n
        if not params.greedy:
            seq.seed = int(params.seed) if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        if params.grammar is not None:  # structured output: a matcher of its own (RequestError: a bad grammar)
            seq.grammar = self.grammar_compiler().matcher(params.grammar)
        seq.text = OutputText(self.tokenizer.incremental_decoder(), params.stop)
        return seq

    def grammar_compiler(self):
        """The grammar compiler over this model's tokenizer (built on first use: its token trie). RequestError, at
        every call once it has failed, where the grammar engine refuses the tokenizer (one whose vocabulary is
        larger than the model's: structured output cannot be served here, and a request asking for it is told so
        rather than meeting an internal error)."""
        if self._grammars_refused is not None:
            raise self._grammars_refused
        if self._grammars is None:
            from ft.engine.text.grammar import GrammarCompiler

            eos = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
            try:
                self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.model_config.vocab_size, eos)
            except ValueError as e:
                self._grammars_refused = RequestError(
                    f"structured output is not available on this server: the grammar engine refuses its tokenizer "
                    f"for a vocabulary of {self.model_config.vocab_size:,} tokens ({e})")
                raise self._grammars_refused from e
        return self._grammars
