"""A request as the scheduler sees it: tokens, progress, the cache it holds."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from ft.engine.detokenizer import OutputText
from ft.engine.sampling_params import SamplingParams

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

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

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
