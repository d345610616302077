"""Overlapped decode (`EngineConfig.overlap_decode`): the engine queues decode step N+1 before it
reads step N's tokens, so that the host's work of a step (reading tokens, their text, the next
step's inputs and launch) runs while the device computes step N+1.

N+1's token ids are gathered on the device from N's sampled ids (`ft.engine.worker.decode_launch`). A
sequence's token from N may end it: by length (known on the host in advance: it is left out of
N+1) or by a stop token (known only once read: N+1 computes that row but writes no KV and no
linear-attention state for it, and its num_computed goes back by one, so that the prefix cache
keeps the state after its last computed token). Plain decode batches only: no grammar (its mask
needs the token), logprobs, penalties or stop strings (ends the host finds in the text), no n > 1
siblings waiting, one process, experts resident or offloaded in read-through mode (the classic
offload path loads misses on the host inside the step). Everything else lands the step in flight
first and steps as before; so does a request arriving (its prefill is the next step) and a sequence
short of a KV page, so that the KV ladder, which moves only between steps, never has one in flight.

A paged n-gram table (`--ngram-table disk`) is read by the host from the tokens: step N+1 is staged while
N computes as any other (its inputs, read-through's `begin_step`), then, last before its forward, waits
for N's sampled ids and reads their rows (`DecodeLauncher.launch`): the device idles for that read, not
for the host's whole step.

Read-through offload keeps its policy's timing: step N+1's `begin_step` takes the spares chosen in
N's `end_step`, and N+1's `end_step` collects N (waiting for N's readback, while N+1 is queued
behind it), as in plain steps, so hits, misses and landings are the same on the CPU (on CUDA, when
a layer's landing reserve is shorter than its misses, which ones land follows the order the
programs claim slots, in plain steps too). Nothing the policy stages for the device makes the host
wait for the step in flight (the staging buffers are rings: `ft.memory.read_through`). The default
(None) turns overlap on where it was measured on the device: CUDA, experts resident (H200, flagship:
+6-10% at batch 1) or offloaded in read-through mode (session 31, `bench/ladder.py --overlap-ab`, one
engine: 80B on the 32 GiB card 208.0 -> 216.5 tok/s over 1,024 tokens, Qwen3.8-Flash-Next on the 16 GiB
card 54.1 -> 55.6; the same hit rates).

num_computed counts the steps launched: a sequence's KV and state reach it once the device has run
them, which every later use of the pools follows in stream order.
"""

from __future__ import annotations

import weakref

from ft.engine.worker.decode_launch import LaunchedDecode
from ft.engine.sched.scheduler import ScheduledWork
from ft.engine.base.sequence import Sequence, Status


class OverlappedDecode:
    """The engine's decode step in flight (`inflight`) and how the next is queued behind it."""

    def __init__(self, engine) -> None:
        # NOTE: a weak reference: no cycle through the engine, which frees its pools when dropped
        self.engine = weakref.proxy(engine)
        self.inflight: LaunchedDecode | None = None
        self.steps = 0  # decode steps queued behind one in flight

    def ok(self, seqs: list[Sequence]) -> bool:
        """Whether a decode step of `seqs` may be queued without reading the tokens before it."""
        e = self.engine
        experts = e.pools.experts
        resident = experts is None or experts.all_resident
        on = e.config.overlap_decode
        if on is None:  # the default: where measured (module docstring)
            on = e.device.type == "cuda"
        # NOTE: the KV ladder moves only in `Engine._step`, which runs with no step in flight: a request
        # waiting or a sequence short of a page (`_next`) drains the step in flight first
        if not on or e.runner.tp is not None or (
                not resident and experts.read_through is None):
            return False
        return all(s.grammar is None and s.logprobs is None and s.prompt_logprobs is None and not s.fork_waiting
                   and not s.params.has_penalties and not s.params.stop for s in seqs)

    def start(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queue a scheduled decode step of `seqs` (its pages are held), then step (`step`)."""
        self.inflight = self.engine.runner.launcher.launch(seqs, None)
        for seq in seqs:
            seq.num_computed += 1
        return self.step()

    def step(self) -> list[Sequence]:
        """Queue the next decode step behind the one in flight (when it may), then take the
        tokens of the one in flight: the sequences that got one, as `Engine.step` returns."""
        e = self.engine
        cur = self.inflight
        queued = self._next(cur)
        e.current_work = ScheduledWork(list(cur.seqs), [1] * len(cur.seqs), False)
        nxt = None
        if queued:
            nxt = e.runner.launcher.launch(queued, cur)
            self.steps += 1
            for seq in queued:
                seq.num_computed += 1
        self.inflight = nxt
        tokens = e.runner.launcher.finish(cur)
        e.current_work = None
        return self._take(cur, tokens, queued)

    def drain(self) -> list[Sequence]:
        """Take the tokens of the step in flight without queuing another ([] when none)."""
        if self.inflight is None:
            return []
        e = self.engine
        cur, self.inflight = self.inflight, None
        e.current_work = ScheduledWork(list(cur.seqs), [1] * len(cur.seqs), False)
        tokens = e.runner.launcher.finish(cur)
        e.current_work = None
        return self._take(cur, tokens, [])

    def _next(self, cur: LaunchedDecode) -> list[Sequence]:
        """The sequences of the step to queue behind `cur` before reading its tokens: cur's running
        sequences whose token from cur cannot end them by length, when nothing else asks for the
        next step (a waiting request, a sequence that joined) and each gets its page; [] when the
        next step must wait for cur's tokens."""
        e = self.engine
        sched = e.scheduler
        live = [s for s in cur.seqs if s.status is Status.RUNNING]
        if sched.waiting or not live or {id(s) for s in live} != {id(s) for s in sched.running} or not self.ok(live):
            return []
        if e.loan is not None and e.loan.due():  # the loan goes out in a plain step (`Engine._step`)
            return []
        if e.mamba_demand is not None and e.mamba_demand.due():  # so do idle mamba slots
            return []
        nxt = [s for s in live if len(s.output_ids) + 1 < s.max_new_tokens and s.num_tokens + 1 < e.context_limit]
        for s in nxt:
            if not sched.grow_for(s, 1):
                return []
        return nxt

    def _take(self, cur: LaunchedDecode, tokens: list[int], queued: list[Sequence]) -> list[Sequence]:
        """`cur`'s tokens join its sequences (those that ended since it was queued discard theirs).
        A sequence that its token ends by a stop token while a step behind is queued for it: that
        step writes nothing for it, so its num_computed goes back by one."""
        e = self.engine
        out: list[Sequence] = []
        e.counters["steps"] += 1
        behind = {id(s) for s in queued}
        for seq, token in zip(cur.seqs, tokens):
            if seq.status is not Status.RUNNING:
                continue  # ended (stop token, abort) after this step was queued: the token is not its
            if id(seq) in behind and token in seq.stop_token_ids:
                seq.num_computed -= 1
            e.take_token(seq, token, None, out)
        return out
