"""A request as the scheduler sees it: tokens, progress, the cache it holds."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from ft.engine.text.detokenizer import OutputText
from ft.engine.base.sampling_params import SamplingParams, TokenLogprob

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """prompt + generated tokens. `num_computed` tokens are in the KV pages and the mamba slot.

    Contract: the mamba state in `mamba_slot` is the state after exactly `num_computed` tokens,
    and `pages` cover at least `num_computed` positions.
    """

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens that came from the prefix cache
    pages: list[int] = field(default_factory=list)
    mamba_slot: int | None = None
    finish_reason: str | None = None
    seed: int = 0  # of its sampling (a random one when the request gave none); unused when greedy
    error: str | None = None  # why it finished with finish_reason "error"
    stop_text: str | None = None  # the text cut before the stop string that ended it
    text: OutputText | None = None  # its generated text, decoded once per token (set by the engine)
    queued_at: float = field(default_factory=time.time)  # unix seconds (compared with rebuild times)
    open_ended: bool = False  # sent without max_tokens: its KV need is known only as it decodes
    # per generated token when params.logprobs is set (else None), filled by the engine
    logprobs: list[TokenLogprob] | None = None
    # per prompt token when params.prompt_logprobs is set (else None): the first stays None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # its grammar's matcher (ft.engine.text.grammar.GrammarMatcher) when params.grammar is set: created
    # when the request is added, advanced by each sampled token, dropped when it finishes
    grammar: Any = None
    # Its life in time.monotonic() seconds (per-request latency metrics): queued; first admitted to
    # run (a preemption does not reset it); first token; finished (any reason). None: not yet.
    # n > 1 sharing one prefill (`Engine.add_request_group`): on a sibling that waits for its parent's
    # prompt prefill, that parent (None once forked or fallen back to an admission of its own); on the
    # parent, its siblings still waiting (emptied at the fork, or when it ends without forking)
    fork_parent: Any = field(default=None, repr=False, compare=False)
    fork_waiting: list = field(default_factory=list, repr=False, compare=False)
    arrived_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def needs_prompt_logits(self) -> bool:
        """The prompt's logprobs are still to compute: its prefill returns the logits of every
        prompt position (and it must not start from the prefix cache, which skips positions)."""
        return self.prompt_logprobs is not None and not self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def possible_length(self) -> int:
        """Tokens this request may occupy at most: prompt + its max new tokens."""
        return len(self.prompt_ids) + self.max_new_tokens

    @property
    def planned_length(self) -> int:
        """Tokens the KV ladder plans for: the possible length of a request that declared its
        max_tokens; for an open-ended one, what it holds now plus the next token (the ladder grows
        as it decodes instead of jumping to the whole context up front)."""
        return self.num_tokens + 1 if self.open_ended else self.possible_length
