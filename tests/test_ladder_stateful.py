"""The KV ladder under arbitrary interleavings (issue 41): a hypothesis state machine on the demo model
(256-token steps, rungs 512 .. 1536, three running requests at most) drives arrivals of short and long
prompts (declared and open-ended lengths), engine steps, aborts, auto on/off, manual rung moves and
the clock (dwell). What must hold after every step:

- no admitted request fails: each ends with `length` or `abort`, no error, and a request with a
  declared length that was not aborted gets all of it;
- a refused request is refused before it is queued (RequestError), with a reason that names the
  cap, and only when its prompt does not fit what the server says it can serve now
  (`servable_context`, which the ladder's auto and the expert floor decide);
- the engine is never left degraded, and at the end (400 more steps, auto as the run left it, then
  aborts) every request has finished cleanly.

Derandomized in CI (the hypothesis profile in conftest.py); bounded steps and examples."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ft.engine import LLM, SamplingParams
from ft.errors import RebuildRefused, RequestError

STEP = 256
CONTEXT = 1536  # rungs 512 .. 1536: prompts past the top rung are refused, the rest fit one
TEARDOWN_STEPS = 400  # then what still runs (open-ended requests decode to the context's end) is aborted
REASONS = ("the context limit is", "the highest KV ladder rung", "the KV cache holds")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class LadderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.llm = LLM(enable_kv_ladder=True, ladder_step_size=STEP, max_running_requests=3,
                       max_seq_len_override=CONTEXT)
        self.eng = self.llm.engine
        self.clock = Clock()
        self.eng.ladder.clock = self.clock
        self.seqs: list = []  # (sequence, declared new tokens or None)
        self.aborted: set[str] = set()

    @initialize(auto=st.booleans())
    def start(self, auto: bool) -> None:
        self.eng.ladder.auto = auto  # (half the runs start with auto off: the cap it puts on admission)

    @rule(n=st.one_of(st.integers(1, 400), st.integers(400, CONTEXT + 100)), new=st.one_of(st.none(), st.integers(1, 40)),
          token=st.integers(40, 240))
    def arrive(self, n: int, new: int | None, token: int) -> None:
        servable = self.eng.servable_context
        try:
            seq = self.eng.add_request([token] * n, SamplingParams(max_new_tokens=new, temperature=0.0,
                                                                   ignore_eos=True))
        except RequestError as e:
            assert n >= servable, (n, servable, str(e))  # refused only when the prompt cannot fit now
            assert any(r in str(e) for r in REASONS), str(e)
            return
        assert n < servable
        self.seqs.append((seq, new))

    @rule(steps=st.integers(1, 25))
    def run(self, steps: int) -> None:
        for _ in range(steps):
            if not self.eng.has_work:
                break
            self.eng.step()

    @precondition(lambda self: any(not s.is_finished for s, _ in self.seqs))
    @rule(pick=st.integers(0, 50))
    def abort(self, pick: int) -> None:
        alive = [s for s, _ in self.seqs if not s.is_finished]
        seq = alive[pick % len(alive)]
        if self.eng.abort(seq.request_id):
            self.aborted.add(seq.request_id)

    @rule(on=st.booleans())
    def auto(self, on: bool) -> None:
        self.eng.ladder.auto = on

    @rule(move=st.one_of(st.sampled_from(["up", "down"]), st.integers(0, 40)))
    def manual(self, move) -> None:
        try:
            self.eng.move_ladder(move)
        except RebuildRefused:
            pass  # (a rung outside the ladder, or one that running requests hold too much for: refused, nothing moved)

    @rule(dt=st.sampled_from([0.5, 5.0, 60.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.t += dt

    @invariant()
    def no_admitted_request_failed(self) -> None:
        assert not self.eng.cache.degraded
        for seq, new in self.seqs:
            if not seq.is_finished:
                continue
            assert seq.error is None, (seq.finish_reason, seq.error)
            if seq.request_id in self.aborted:
                continue
            assert seq.finish_reason == "length", seq.finish_reason
            if new is not None:
                assert len(seq.output_ids) == seq.max_new_tokens, (len(seq.output_ids), seq.max_new_tokens, new)

    def teardown(self) -> None:
        try:
            for _ in range(TEARDOWN_STEPS):  # (auto as the run left it: an admitted request needs no help)
                if not self.eng.has_work:
                    break
                self.eng.step()
            self.no_admitted_request_failed()
            for seq, _ in self.seqs:  # bounded time: what still decodes is aborted, and must end cleanly
                if not seq.is_finished and self.eng.abort(seq.request_id):
                    self.aborted.add(seq.request_id)
            assert all(s.is_finished for s, _ in self.seqs) and not self.eng.has_work
            self.no_admitted_request_failed()
        finally:
            self.llm.close()


TestLadderMachine = LadderMachine.TestCase
TestLadderMachine.settings = settings(max_examples=7, stateful_step_count=15, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
pytestmark = pytest.mark.slow
