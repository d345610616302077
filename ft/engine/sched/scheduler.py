"""FIFO scheduler: a prefill step (chunked, carrying the running decodes along), otherwise one batched
decode step of all running requests.

Mixed steps (`mix_decode`): while a prompt is prefilled in chunks, every step also carries one token of
each running request that is decoding, so a long prompt never freezes the streams: their next token
comes after one chunk's time, not after the whole prompt's. The step's token budget is shared (the
decode rows first), and the prompt tokens of a step that decodes are at most `mixed_prefill_tokens`
(default: no bound of their own), which bounds the streams' gap between two tokens while prompts
arrive. A prefill of one request whose whole remaining prompt is at most
`solo_prefill_tokens` runs alone: it is short, and alone it replays the prefill CUDA graphs
(`ft.engine.worker.prefill_graphs`, one sequence each), which a mixed step cannot.

Every mutation has its check beside it: a request is admitted only when a mamba slot and the
KV pages of its first chunk can be had (evicting prefix-cache entries if needed); a decode step
that cannot get a page preempts the newest request (it is recomputed later, prefix cache first).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ft.memory.kv_pool import KVPool
from ft.memory.mamba_pool import MambaPool
from ft.engine.sched.prefix_cache import PrefixCache
from ft.engine.base.sequence import Sequence, Status


@dataclass
class ScheduledWork:
    """Sequences of one forward pass and how many new tokens each contributes."""

    seqs: list[Sequence]
    num_tokens: list[int]
    is_prefill: bool


class Scheduler:
    def __init__(
        self,
        kv: KVPool,
        mamba: MambaPool,
        prefix_cache: PrefixCache,
        max_running_requests: int,
        max_prefill_length: int,
        max_prompt_logit_tokens: int | None = None,
        mix_decode: bool = False,
        solo_prefill_tokens: int = 0,
        mixed_prefill_tokens: int | None = None,
    ) -> None:
        self.kv, self.mamba, self.prefix = kv, mamba, prefix_cache
        self.max_running = max_running_requests
        self.max_prefill = max_prefill_length
        # NOTE: a request with prompt logprobs (echo) makes the model return the logits of every
        # position of its chunk (a vocabulary-wide row each): its chunks and a step's sum of them stay
        # under this many tokens, so those logits fit the activation reserve (`Engine`)
        self.max_prompt_logits = max_prompt_logit_tokens or max_prefill_length
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.admission_paused = False  # a rebuild waits for running requests to release memory
        self.hold_head = False  # this step only: the first waiting request waits (a deferred ladder grow)
        self.mix_decode = mix_decode
        self.solo_prefill_tokens = solo_prefill_tokens
        self.mixed_prefill_tokens = mixed_prefill_tokens

    # --------------------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --------------------------------------------------------------------------- scheduling
    def schedule(self) -> ScheduledWork | None:
        work = self._schedule_prefill()
        if work.seqs:
            return work
        return self._schedule_decode()

    def _schedule_prefill(self) -> ScheduledWork:
        # running requests with one token to compute decode; mixed into this step if it prefills (their
        # rows come out of the budget, so a step never has more tokens than the buffers hold)
        decoding = [s for s in self.running if s.num_uncomputed == 1] if self.mix_decode else []
        if len(decoding) >= self.max_prefill:
            decoding = []
        budget = self.max_prefill - len(decoding)
        if decoding and self.mixed_prefill_tokens:
            budget = min(budget, self.mixed_prefill_tokens)
        logit_budget = self.max_prompt_logits  # prompt positions whose logits this step returns
        seqs, counts = [], []

        def room(seq: Sequence) -> int:
            return min(seq.num_uncomputed, budget, logit_budget if seq.needs_prompt_logits else budget)

        for seq in self.running:  # requests in the middle of a chunked prefill
            if budget and seq.num_uncomputed > 1 and room(seq):
                n = self._grow_for(seq, room(seq))
                if n:
                    seqs.append(seq)
                    counts.append(n)
                    budget -= n
                    logit_budget -= n if seq.needs_prompt_logits else 0
        while (budget and self.waiting and len(self.running) < self.max_running and not self.admission_paused
               and not self.hold_head):
            seq = self.waiting[0]
            if seq.needs_prompt_logits and not logit_budget:
                break
            if not self._admit(seq):
                break
            n = self._grow_for(seq, room(seq))
            if not n:  # not even one chunk's pages: stay first in line
                self._release(seq)
                seq.num_computed = seq.num_cached = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = Status.RUNNING
            if seq.scheduled_at is None:
                seq.scheduled_at = time.monotonic()
            seqs.append(seq)
            counts.append(n)
            budget -= n
            logit_budget -= n if seq.needs_prompt_logits else 0
        if not seqs or not decoding or (len(seqs) == 1 and counts[0] == seqs[0].num_uncomputed
                                        and counts[0] <= self.solo_prefill_tokens):
            return ScheduledWork(seqs, counts, True)
        rows = [s for s in decoding if self._grow_for(s, 1)]  # (one without a page waits for the decode step)
        return ScheduledWork(rows + seqs, [1] * len(rows) + counts, True)

    def _schedule_decode(self) -> ScheduledWork | None:
        """The running requests with one token to compute, each with its page (the last admitted ones
        preempted until it has one). A request in the middle of its prompt is no decode row: the prefill
        step found no page for its next chunk, so it waits, and when nothing decodes the last running
        request is preempted so that the others' chunks find pages. (Taking it as a row sampled a token
        in the middle of its prompt.)"""
        if not self.running:
            return None
        seqs: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running or seq.num_uncomputed > 1:  # preempted below; mid-prompt: waits
                continue
            while not self._grow_for(seq, 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                seqs.append(seq)
        seqs = [s for s in seqs if s in self.running]
        if not seqs and len(self.running) > 1:  # only prompts, and none found a page for its chunk
            self._preempt(self.running[-1])
            work = self._schedule_prefill()
            return work if work.seqs else None
        return ScheduledWork(seqs, [1] * len(seqs), False) if seqs else None

    # --------------------------------------------------------------------------- resources
    def _admit(self, seq: Sequence) -> bool:
        """Give `seq` a mamba slot and, when the prefix cache has its start, that prefix."""
        # NOTE: a request that wants its prompt's logprobs bypasses the prefix cache's read: a hit would
        # skip computing the cached positions, whose logits it needs
        match = None if seq.needs_prompt_logits else self.prefix.match(seq.token_ids)
        entry = match.entry if match else None
        cow = 1 if match and match.num_tokens % self.kv.page_size else 0
        if not self.prefix.evict_for(pages=cow, slots=1, protect=entry):
            return False
        seq.mamba_slot = self.mamba.allocate()
        if match:
            seq.pages = self.prefix.apply(match, seq.mamba_slot)
            seq.num_computed = seq.num_cached = match.num_tokens
        self.prefix.query_tokens += seq.num_tokens
        return True

    def fork(self, parent: Sequence, seq: Sequence) -> bool:
        """Start `seq` (same prompt, holding nothing) from `parent`'s just-completed prompt prefill,
        as the prefix cache starts a hit: a mamba slot of its own with the parent's state copied,
        the parent's full prompt pages shared (one more reference each), the partial last page
        copied into a page of its own (both will write into it); `seq` joins the running batch with
        its prompt computed. Call it after the step that computed the prompt's last token and
        before any later forward (the parent's next decode changes its state and its last page).
        False, holding nothing, when a slot or page cannot be had (prefix-cache entries are evicted
        first), the running batch is full, or admission is paused (a rebuild waits for memory)."""
        n = len(parent.prompt_ids)
        assert parent.num_computed == n and parent.mamba_slot is not None and not seq.pages, "not a fork point"
        if self.admission_paused or len(self.running) >= self.max_running:
            return False
        full, partial = divmod(n, self.kv.page_size)
        if not self.prefix.evict_for(pages=1 if partial else 0, slots=1):
            return False
        seq.mamba_slot = self.mamba.allocate()
        self.mamba.copy_slot(parent.mamba_slot, seq.mamba_slot)
        pages = list(parent.pages[:full])
        self.kv.ref(pages)
        if partial:
            (own,) = self.kv.allocate(1)
            self.kv.copy_page(parent.pages[full], own)
            pages.append(own)
        seq.pages = pages
        seq.num_computed, seq.num_cached = n, parent.num_cached
        seq.status = Status.RUNNING
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()
        self.running.append(seq)
        return True

    def requeue_first(self, seqs: list[Sequence]) -> None:
        """Queue `seqs` (holding nothing) at the front, in their order: next in line to be admitted."""
        self.waiting.extendleft(reversed(seqs))

    def grow_for(self, seq: Sequence, n: int) -> int:
        """Pages so `seq` can compute n more tokens past num_computed (evicting prefix-cache entries
        if needed); n, or 0 when they cannot be had. The engine's overlapped decode queues a step
        before the scheduler sees the last one's tokens."""
        return self._grow_for(seq, n)

    def _grow_for(self, seq: Sequence, n: int) -> int:
        """Pages so `seq` can compute n more tokens; returns n, or 0 when no page can be had."""
        need = self.kv.pages_for(seq.num_computed + n) - len(seq.pages)
        if need > 0:
            if not self.prefix.evict_for(pages=need):
                if seq.num_uncomputed > 1 and len(seq.pages) * self.kv.page_size > seq.num_computed:
                    # a shorter prefill chunk that fits the pages already held
                    return len(seq.pages) * self.kv.page_size - seq.num_computed
                return 0
            seq.pages += self.kv.allocate(need)
        return n

    def _preempt(self, seq: Sequence) -> None:
        """Free everything `seq` holds; it goes back to the front of the queue to be recomputed."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq.pages)
        seq.pages = []
        if seq.mamba_slot is not None:
            self.mamba.free(seq.mamba_slot)
            seq.mamba_slot = None

    def finish(self, seq: Sequence, reason: str, cache: bool = True) -> None:
        """Mark `seq` finished and hand its pages and state to the prefix cache (or free them)."""
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.monotonic()
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.mamba_slot is None:
            return
        if cache and seq.num_computed > 0:
            self.prefix.insert(seq.token_ids[: seq.num_computed], seq.pages, seq.mamba_slot)
            seq.pages, seq.mamba_slot = [], None
        else:
            self._release(seq)
