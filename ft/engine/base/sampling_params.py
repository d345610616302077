"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from ft.errors import RequestError

MAX_LOGPROBS = 20
"""The most top logprobs a request may ask for, per token (generated or prompt): vLLM's default."""


class TokenLogprob(NamedTuple):
    """A token's logprob under the model's raw distribution, and the `top` best alternatives as
    (token id, logprob), best first (as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy. max_new_tokens None: up to the context limit.

    stop_token_ids end generation after emitting one of them (the checkpoint's EOS ids are added
    unless ignore_eos); stop strings end it when the text contains one (the text is cut before it).

    Logit processing, in vLLM's order (see `ft.engine.sampling.sampler.sample`): `logit_bias` (token id ->
    added to its logit), then `repetition_penalty` (HF/vLLM: over prompt and generated tokens, a
    positive logit is divided by it, a negative one multiplied; 1 is off), `frequency_penalty`
    (minus penalty x count) and `presence_penalty` (minus penalty once) over the generated tokens
    (OpenAI), then the temperature, `min_p` (drop tokens whose probability is below min_p times
    the best one's; 0 is off), top-k and top-p. Greedy rows take the argmax after the bias and
    the penalties.

    logprobs: None, or how many top alternatives each generated token reports besides its own
    logprob (0: only its own). prompt_logprobs: the same for every prompt token (the first one has
    none). Both are of the model's raw distribution (log_softmax of the logits, before bias,
    penalties and temperature), as vLLM reports them by default.
    """

    max_new_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # (token id, bias) pairs sorted by id; a dict is accepted and converted
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # structured output: (kind, text), kind "json_schema" (text: the schema as JSON) or "lark"; the
    # engine compiles it into a matcher per sequence (ft.engine.text.grammar) that masks each step's logits
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise RequestError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} must be finite, got {getattr(self, name)}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        pairs: dict[int, float] = {}
        for token, value in bias:
            value = float(value)
            if not -100 <= value <= 100:
                raise RequestError(f"logit_bias values must be in [-100, 100], got {value} for token {token}")
            pairs[int(token)] = value
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs.items())))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if any(s == "" for s in self.stop):  # (any text contains it: the first token would end every request)
            raise RequestError("stop: an empty string would end the generation at its first token; leave it out")
        if self.grammar is not None:
            if not (isinstance(self.grammar, tuple) and len(self.grammar) == 2
                    and self.grammar[0] in ("json_schema", "lark") and isinstance(self.grammar[1], str)):
                raise RequestError(f"grammar must be ('json_schema' | 'lark', text), got {self.grammar!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise RequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the sequence's token counts (any penalty set)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
