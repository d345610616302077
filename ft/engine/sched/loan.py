"""The prefill reserve's loan to the expert slots (`--lend-prefill-reserve`, `EngineConfig.lend_prefill_reserve`).

An offloaded card reserves activation memory for its largest prefill chunk (16,384 tokens on a 32 GiB
card: ~3 GiB with the streamed passes' workspace for the 80B), which only a long prompt's chunks use;
a chat turn's prompt of a thousand tokens needs a tenth of it. While no step needs more than
`keep_tokens` tokens, the expert slots borrow the rest (`CacheManager.lend`: a live rebuild that
grows the expert pool past the budget by `loan_bytes`), and a step that needs more recalls what it
needs first (`CacheManager.recall`, sized by `RankState.loan_beside`: the chunk's reserve less that
step's; the pool shrinks by that much, the forgotten experts are read from host memory again when next
used). The whole loan goes out again once no long prompt is pending (running with more than keep_tokens
to compute, or waiting: a queue of long prompts keeps it in) and none ran for the hold
(`EngineConfig.loan_hold_s`, 0 by default: at the first plain step after a long prompt's last chunk). The
hold is a trade: the decode right after a long prompt runs on the smaller pool until it ends (issue 39's
decode-after-8K row), while a shorter hold pays a lend and a recall (each a live rebuild, 0.01-0.06 s) per
long prompt of a stream whose prompts arrive apart. `bench/offload_prefill.py --loan-holds` (H100, session
46, the 80B on a 32 GiB card, 256 tokens after an 8K prompt): hold 0 192.0 / 192.2 / 191.3 tok/s, 1 s 191.1,
2 s (the default before) 186.7 / 185.3, against ~200-202 after a 32-token prompt: 0.95-0.96 with no hold,
0.92-0.93 with 2 s; the 8K prompt's TTFT alike (0.73-0.75 s; 0.73-0.84 at 2 s).

Every resize other than the loan's recalls it first (`CacheManager.rebuild`), and the reachable ranges
are the budget's alone, so what the server advertises stays reachable. The default where it can lend
(`EngineConfig.lends_reserve`); H200, through `ft serve` (bench/RESULTS.md, session 35): the 80B on a 32 GiB
card 12,566 -> 13,948 slots, +2.7% / +2.8% output tok/s at concurrency 1 / 8; Qwen3.8-Flash-Next on a 16 GiB
card 1,607 -> 1,761 slots, +2.2%; a recall takes 0.01-0.06 s, an 8K prompt's TTFT 2,912 against 2,909 ms.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ft.engine.cache.manager import CacheManager
from ft.engine.sched.scheduler import Scheduler, ScheduledWork
from ft.errors import RebuildFailed

log = logging.getLogger("ft.engine")

class ReserveLoan:
    """When the expert slots borrow the idle prefill reserve and when they give it back (the module docstring)."""

    def __init__(self, cache: CacheManager, scheduler: Scheduler, keep_tokens: int, beside: Callable[[int], int],
                 *, hold_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """`beside(tokens)`: bytes of the loan that may stay out while a step of that many tokens runs
        (`RankState.loan_beside`: all of it up to keep_tokens, none at the whole chunk). `hold_s`: seconds
        after the last long step (or the last lend tried) before the loan goes out again; 0 lends at the
        first plain step after a long prompt's last chunk."""
        if hold_s < 0:
            raise ValueError(f"the loan's hold is {hold_s} s; it must be 0 or more")
        self.cache, self.scheduler, self.keep_tokens, self.clock = cache, scheduler, keep_tokens, clock
        self.beside, self.hold_s = beside, hold_s
        self.quiet_since = float("-inf")  # the last step over keep_tokens, or the last lend tried: due from
        # hold_s after it
        self.failed: str | None = None  # a recall that could not run: the loan is never made again
        self.recalls = 0

    def _long_pending(self) -> bool:
        """A running request with more than keep_tokens prompt tokens to compute, or a waiting one whose
        prompt is longer (its cached prefix not counted: the match is made at admission)."""
        keep = self.keep_tokens
        return any(s.num_uncomputed > keep for s in self.scheduler.running) or \
            any(len(s.prompt_ids) > keep for s in self.scheduler.waiting)

    def due(self) -> bool:
        """Whether the loan should go out now (the overlapped decode stops queuing so that the engine's
        next plain step makes it)."""
        return self.failed is None and self.cache.lent < self.cache.loan_bytes \
            and self.clock() - self.quiet_since >= self.hold_s and not self._long_pending()

    def lend(self, reason: str = "no prompt needs the prefill reserve") -> dict | None:
        """Lend now if nothing prevents it (`CacheManager.lend`); the next try waits hold_s
        whatever the outcome (a refusal, a user's fixed expert size)."""
        self.quiet_since = self.clock()
        return self.cache.lend(reason)

    def before_step(self) -> None:
        """At the top of a plain engine step: lend when due."""
        if self.due():
            self.lend()

    def before_run(self, work: ScheduledWork) -> None:
        """After scheduling, before the forward: a step over keep_tokens recalls what of the loan it needs
        first (`beside`: a 4K step on a 16K chunk's reserve leaves most of it out). A recall that fails
        leaves the loan out (the pools as they were) and is logged; the step still runs, and no loan is
        made again."""
        tokens = sum(work.num_tokens)
        if tokens <= self.keep_tokens:
            return
        self.quiet_since = self.clock()
        keep = self.beside(tokens)
        if self.cache.lent <= keep:
            return
        try:
            self.cache.recall(f"a step of {tokens} tokens needs the prefill reserve", keep)
            self.recalls += 1
        except RebuildFailed as e:
            self.failed = str(e)
            log.error("the prefill reserve's loan could not be recalled (%s); the step runs with what is free, "
                      "and the loan is not made again", e)
