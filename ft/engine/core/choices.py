"""n choices of one prompt sharing one prompt prefill (an API call with n > 1): `ChoiceGroups`.

The first request of a group is the parent, queued as usual. The others are siblings: they wait
outside the scheduler, holding nothing, until the step that computes the parent's last prompt
token (the one that samples its first token). In that step's postprocess each sibling forks
(`Scheduler.fork`: its own mamba slot with the parent's state, the full prompt pages shared, the
partial last page copied), samples its first token from the parent's last-position logits with
its own parameters and seed (`ModelRunner.sample_logits`: what an independent request would draw
from the same row), and joins the running batch as a decode sequence.

Fallbacks, correct but slower (each then prefills the prompt itself, an ordinary admission): a
sibling whose fork cannot get its resources (no mamba slot or page, the running batch full, a
rebuild pending) is queued first in line; so are the waiting siblings when the parent ends before
its prefill completes (aborted, failed); and a group with prompt logprobs (echo) or a grammar is
queued as independent requests from the start. A sibling that forked owns its state: aborting the
parent later does not touch it. Each request can be aborted by its id, a waiting sibling too. A
preempted parent's siblings keep waiting for its recomputed prefill.

The links live on the sequences (`Sequence.fork_parent` on a waiting sibling, `.fork_waiting` on
its parent); this class is the only writer of both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ft.engine.base.sequence import Sequence

if TYPE_CHECKING:
    from ft.engine.sched.scheduler import Scheduler
    from ft.engine.worker.model_runner import ModelRunner

__all__ = ["ChoiceGroups"]


class ChoiceGroups:
    """Queues n-choice groups and forks their waiting siblings at the parent's first token, through
    the scheduler's and the model runner's public methods."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def queue(self, seqs: list[Sequence]) -> None:
        """Queue a checked group (seqs[0] the parent): the siblings wait for its prefill when they can
        share it (no prompt logprobs, no grammar), else every one is queued on its own."""
        parent, siblings = seqs[0], seqs[1:]
        share = all(s.prompt_logprobs is None and s.grammar is None for s in seqs)
        self.scheduler.add(parent)
        for seq in siblings:
            if share:
                seq.fork_parent = parent
                parent.fork_waiting.append(seq)
            else:
                self.scheduler.add(seq)

    @staticmethod
    def waiting(requests) -> list[Sequence]:
        """The siblings among `requests` that still wait for their parent's prefill."""
        return [s for s in requests if s.fork_parent is not None]

    @staticmethod
    def detach(seq: Sequence) -> None:
        """`seq` is aborted: a sibling still waiting leaves its parent's list (it holds nothing)."""
        if seq.fork_parent is not None:
            seq.fork_parent.fork_waiting.remove(seq)
            seq.fork_parent = None

    def release(self, parent: Sequence) -> None:
        """`parent` ended before its prompt prefill completed: its waiting siblings (aborted with it
        only when their own ids are aborted) are queued first in line, each to prefill itself."""
        sibs, parent.fork_waiting = parent.fork_waiting, []
        for sib in sibs:
            sib.fork_parent = None
        self.scheduler.requeue_first(sibs)

    def fork(self, parent: Sequence, row: int, runner: ModelRunner) -> list[tuple[Sequence, int, object]]:
        """The fork point of `parent` (its prompt was just computed by `runner`, its first token
        sampled from logits row `row` of this step): each waiting sibling forks and samples its first token from
        that row, or, without the resources, is queued to prefill itself. Returns (sibling, token,
        logprob) of those forked. Call it before the parent can finish (its pages and slot would go)
        and before any later forward changes its state and its last page."""
        sibs, parent.fork_waiting = parent.fork_waiting, []
        logits = runner.last_logits
        forked, fallback = [], []
        for sib in sibs:
            sib.fork_parent = None
            ok = logits is not None and self.scheduler.fork(parent, sib)
            (forked if ok else fallback).append(sib)
        self.scheduler.requeue_first(fallback)
        if not forked:
            return []
        rows = logits[row : row + 1].expand(len(forked), -1)
        tokens, logprobs = runner.sample_logits(rows, forked)
        return list(zip(forked, tokens, logprobs))
