"""The KV ladder on the demo model with a small step (256 tokens, rungs 512 .. 8192)."""

from __future__ import annotations

import pytest

from ft.engine import LLM, SamplingParams
from ft.memory.layout import Geometry
from ft.errors import ConfigError

STEP = 256
LONG = [50 + i % 200 for i in range(500)]  # with 20 new tokens it needs more than the first rung (512)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(**opts):
    base = dict(enable_kv_ladder=True, ladder_step_size=STEP, max_running_requests=2)
    llm = LLM(**{**base, **opts})
    clock = Clock()
    llm.engine.ladder.clock = clock
    return llm, clock


def admit(eng, prompt, max_new):
    """Queue a request and step until it has its first token."""
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    while not seq.output_ids:
        eng.step()
    return seq


def expected_moe(eng, kv):
    """The most expert slots whose geometry's allocator bytes fit the budget beside `kv` (counted down)."""
    lay, g, budget = eng.cache.layout, eng.cache.geometry, eng.cache.budget.budget_bytes
    moe = eng.cache.total_experts
    while moe > 0 and lay.nbytes(Geometry(moe, kv, g.mamba_slots)) > budget:
        moe -= 1
    return moe


def test_rungs_and_startup():
    llm, _ = make()
    lad = llm.engine.ladder
    assert lad.rungs == list(range(512, 8192 + 1, 256))
    assert llm.engine.cache.geometry.kv_tokens == 512 and lad.current(llm.engine.cache.geometry.kv_tokens) == 0
    assert llm.engine.cache.geometry.moe_slots == expected_moe(llm.engine, 512)
    with pytest.raises(ConfigError, match="--num-tokens conflicts with --enable-kv-ladder"):
        LLM(enable_kv_ladder=True, num_tokens=1024)


def test_climbs_every_rung_to_the_context_limit():
    llm, _ = make(max_running_requests=1)
    eng = llm.engine
    lad = eng.ladder
    prompt = [65, 66, 67, 68, 69, 70, 71, 72]
    for i in range(len(lad.rungs) - 1):
        kv = eng.cache.geometry.kv_tokens
        seq = admit(eng, prompt, kv - len(prompt))  # exactly fills the rung: moves one up
        assert eng.cache.geometry.kv_tokens == lad.rungs[i + 1] and lad.current(eng.cache.geometry.kv_tokens) == i + 1
        h = eng.cache.history[-1]
        assert (h["trigger"], h["status"], h["to"]["kv"]) == ("ladder", "ok", lad.rungs[i + 1])
        assert h["to"]["moe"] == expected_moe(eng, lad.rungs[i + 1]) and "grow" in h["reason"]
        eng.abort(seq.request_id)
    assert eng.cache.geometry.kv_tokens == 8192
    seq = admit(eng, prompt, 8192 - len(prompt))  # the last rung: nowhere to go
    assert eng.cache.geometry.kv_tokens == 8192 and len(eng.cache.history) == len(lad.rungs)


def test_queue_order_is_kept_when_a_request_needs_a_rebuild():
    llm, _ = make(max_running_requests=1)
    eng = llm.engine
    p = [70, 71, 72, 73]
    a = eng.add_request(p, SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    b = eng.add_request(p + [74], SamplingParams(max_new_tokens=900, temperature=0.0, ignore_eos=True))
    c = eng.add_request(p + [75], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    order = []
    while not all(s.is_finished for s in (a, b, c)):
        for s in eng.step():
            if s.is_finished:
                order.append(s)
            if s is b and len(b.output_ids) == 2:
                eng.abort(b.request_id)
                order.append(b)
    assert order == [a, b, c]
    assert eng.cache.history[-1]["trigger"] == "ladder" and eng.cache.history[-1]["to"]["kv"] == 1024


def long_then_stop(llm, prompt):
    """A request that may need 3000 more tokens (the ladder climbs) but stops after three: its
    third greedy token, learnt first, is its stop token. Finishing leaves a prefix-cache entry."""
    probe = llm.generate(prompt_token_ids=[prompt], max_new_tokens=3, temperature=0.0, ignore_eos=True)[0]
    stop = probe.token_ids[2]
    first = probe.token_ids.index(stop)
    out = llm.generate(prompt_token_ids=[prompt], max_new_tokens=3000, temperature=0.0, ignore_eos=True,
                       stop_token_ids=[stop])[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == first + 1
    return out


def test_shrinks_for_an_unrelated_request_after_the_dwell_not_for_a_second_turn():
    llm, clock = make(ladder_dwell_s=10, ladder_grow_hold_s=20)
    eng = llm.engine
    long_prompt = list(range(60, 124))
    out = long_then_stop(llm, long_prompt)
    top = eng.cache.geometry
    assert top.kv_tokens == 3072 and eng.cache.history[-1]["trigger"] == "ladder"  # 64 + 3000 < 3072
    # a second turn of the same conversation (it reuses its whole first turn) never shrinks
    clock.t += 100
    turn2 = long_prompt + out.token_ids + [33, 34]
    seq = admit(eng, turn2, 4)
    assert eng.cache.geometry == top and seq.num_cached > len(long_prompt)
    eng.run_until_done([seq])
    # an unrelated short request right after a grow is held back by the hysteresis ...
    llm2, clock2 = make(ladder_dwell_s=10, ladder_grow_hold_s=20)
    e2 = llm2.engine
    long_then_stop(llm2, long_prompt)
    high = e2.cache.geometry
    clock2.t += 5
    admit(e2, [90, 91, 92], 20)
    assert e2.cache.geometry == high and "held back" in e2.ladder.last_decision
    # ... and shrinks the ladder once the dwell and the hold have passed
    clock2.t += 30
    s = admit(e2, [93, 94, 95], 20)
    low = e2.cache.geometry
    assert low.kv_tokens == 512 and low.moe_slots > high.moe_slots  # expert slots came back
    h = e2.cache.history[-1]
    assert h["trigger"] == "ladder" and h["status"] == "ok" and "shrink" in h["reason"]
    e2.run_until_done([s])


def test_fault_in_a_ladder_rebuild_keeps_the_old_rung_and_says_why():
    llm, _ = make()
    eng = llm.engine
    eng.cache.rebuilder.fault_at = "grow kv"
    seq = eng.add_request([80, 81, 82], SamplingParams(max_new_tokens=700, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.cache.rebuilder.fault_at = None
    # nothing else runs, so waiting cannot help: rejected with the reason, never admitted silently
    assert seq.finish_reason == "error" and "could not grow" in seq.error and "grow kv" in seq.error
    assert eng.cache.geometry.kv_tokens == 512 and eng.ladder.current(512) == 0
    h = eng.cache.history[-1]
    assert (h["trigger"], h["status"]) == ("ladder", "rolled_back") and "grow kv" in h["error"]
    assert "not done" in eng.ladder.last_decision
    ok = admit(eng, [80, 81, 82], 100)  # a request that fits is served at the old rung
    eng.run_until_done([ok])
    assert len(ok.output_ids) == 100


def test_grow_deferred_while_others_run_then_done():
    llm, _ = make()
    eng = llm.engine
    first = admit(eng, [1, 2, 3], 30)
    eng.cache.rebuilder.fault_at = "grow kv"
    seq = eng.add_request(LONG, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.cache.rebuilder.fault_at = None
    assert seq in eng.scheduler.waiting and not seq.is_finished  # deferred, not failed
    eng.run_until_done([first, seq])
    assert seq.finish_reason == "length" and eng.cache.geometry.kv_tokens >= 768


def test_grow_is_clamped_to_the_highest_rung_that_keeps_the_expert_floor():
    llm, _ = make(cache_budget="12MiB")
    eng = llm.engine
    floor, rungs = eng.cache.expert_floor, eng.ladder.rungs
    keep = [r for r in rungs if expected_moe(eng, r) >= floor]
    assert keep[-1] < rungs[-1]  # the card is too small for the top rungs
    seq = admit(eng, [7, 8, 9], 8000)
    g = eng.cache.geometry
    assert g.kv_tokens == keep[-1] and g.moe_slots == expected_moe(eng, keep[-1]) >= floor
    h = eng.cache.history[-1]
    assert h["status"] == "ok" and "clamped" in h["reason"]
    assert not seq.is_finished


def test_auto_off_and_manual_moves():
    llm, _ = make()
    eng, lad = llm.engine, llm.engine.ladder
    lad.auto = False
    admit(eng, [1, 2, 3], 700)
    assert eng.cache.geometry.kv_tokens == 512
    eng.move_ladder("up")
    assert eng.cache.geometry.kv_tokens == 768
    eng.move_ladder(5)
    assert eng.cache.geometry.kv_tokens == lad.rungs[5]
    eng.move_ladder("down")
    assert eng.cache.geometry.kv_tokens == lad.rungs[4]
    from ft.errors import RebuildRefused

    n = len(lad.rungs)  # the API counts from 0, people from 1: the refusal says both
    with pytest.raises(RebuildRefused, match=rf"rung {n + 1} is outside 1..{n} \(the API's `rung` is the index {n}, "
                                             rf"outside 0..{n - 1}\)"):
        eng.move_ladder(n)


def test_failed_rollback_in_a_ladder_move_fails_no_running_request():
    llm, _ = make()
    eng = llm.engine
    first = admit(eng, [1, 2, 3], 30)
    eng.cache.rebuilder.fault_at, eng.cache.rebuilder.fault_in_undo = "grow kv", "shrink moe"
    seq = eng.add_request(LONG, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    eng.step()  # the grow fails and its rollback too: the engine says so and steps on
    eng.cache.rebuilder.fault_at = eng.cache.rebuilder.fault_in_undo = None
    assert eng.cache.degraded and eng.cache.history[-1]["status"] == "degraded"
    eng.run_until_done([first, seq])
    assert first.finish_reason == "length" and len(first.output_ids) == 30
    assert seq.finish_reason == "length"


def test_open_ended_request_is_admitted_at_the_rung_and_grows_while_it_decodes():
    """A request without max_tokens does not jump to the top rung: it starts on the current one and the
    ladder climbs as its KV fills, before a page would be missing; it reaches the context limit,
    and its tokens equal those of an engine started with the whole context (and no ladder). With
    overlapped decode (offloaded experts read through) the same: a step short of a page is not
    queued behind the one in flight, so each grow runs with no step in flight."""
    prompt = [65 + i % 50 for i in range(100)]  # 156 decode steps cross both rungs
    outs = []
    for overlap in (False, True):
        # a budget where experts and KV compete (not every expert fits)
        llm, _ = make(ladder_step_size=64, max_seq_len_override=256, max_running_requests=1, cache_budget="20MiB",
                      overlap_decode=overlap)
        eng = llm.engine
        assert eng.ladder.rungs == [128, 192, 256] and eng.cache.geometry.kv_tokens == 128
        moe_start = eng.cache.geometry.moe_slots
        seq = eng.add_request(prompt, SamplingParams(max_new_tokens=None, temperature=0.0, ignore_eos=True))
        while not seq.output_ids:
            eng.step()
        assert eng.cache.geometry.kv_tokens == 128  # admitted at the current rung: no grow up front
        eng.run_until_done([seq], timeout_s=300)
        assert seq.finish_reason == "length" and seq.num_tokens == 256 and seq.error is None
        grows = [h for h in eng.cache.history if h["trigger"] == "ladder"]
        assert [(h["status"], h["to"]["kv"]) for h in grows] == [("ok", 192), ("ok", 256)], overlap
        assert all("grow while decoding" in h["reason"] for h in grows)
        assert eng.cache.geometry.moe_slots < moe_start  # paid for with expert slots, as the ladder does
        assert (eng.overlapped_steps > 100) == overlap and eng.pools.experts.read_through is not None
        outs.append(seq.output_ids)
    ref = LLM(max_seq_len_override=256, num_tokens=256, max_running_requests=1).generate(
        prompt_token_ids=[prompt], max_new_tokens=len(outs[0]), temperature=0.0, ignore_eos=True)[0]
    assert outs[0] == ref.token_ids and outs[1] == ref.token_ids


def test_declared_max_tokens_still_grows_up_front():
    llm, _ = make(ladder_step_size=64, max_seq_len_override=256, max_running_requests=1)
    eng = llm.engine
    admit(eng, [65] * 40, 150)  # 190 tokens declared: the 192 rung before it starts
    assert eng.cache.geometry.kv_tokens == 192
    assert eng.cache.history[-1]["trigger"] == "ladder" and "grow: request" in eng.cache.history[-1]["reason"]


def test_a_request_that_can_never_fit_is_refused_at_admission_with_the_reason():
    """Without the ladder the KV cache caps what a request can reach; with it, the highest rung that
    keeps the expert floor does. Past either, the request is refused before it runs (RequestError,
    a 400 in the server), with the cap named."""
    from ft.errors import RequestError

    plain = LLM(max_seq_len_override=1024, num_tokens=256, max_running_requests=1).engine
    assert plain.servable_context == 256
    with pytest.raises(RequestError, match="the KV cache holds 256 tokens"):
        plain.add_request([65] * 300, SamplingParams(max_new_tokens=4))
    seq = plain.add_request([65] * 200, SamplingParams(max_new_tokens=None, temperature=0.0, ignore_eos=True))
    assert seq.max_new_tokens == 56  # an open-ended request stops where the KV ends, never fails there
    # with the ladder, on a budget where the top rungs would leave less than the expert floor
    llm, _ = make(ladder_step_size=64, max_seq_len_override=4096, max_running_requests=1, cache_budget="3MiB")
    eng = llm.engine
    top = eng.servable_context
    assert eng.cache.geometry.kv_tokens <= top < 4096 and top in eng.ladder.rungs
    assert eng.cache.moe_beside(top) is not None and eng.cache.moe_beside(top + 64) is None
    with pytest.raises(RequestError, match=f"the highest KV ladder rung that keeps the expert floor holds {top}"):
        eng.add_request([65] * top, SamplingParams(max_new_tokens=4))


def test_with_auto_off_the_kv_cache_caps_what_is_admitted():
    """Auto off, nothing grows by itself: a request is refused up front or capped to the KV cache (it
    ends with `length`), never admitted for a rung that will not come and failed after it ran (issue
    41, item 2). Auto on again, the rungs count again."""
    from ft.errors import RequestError

    llm, _ = make()
    eng, lad = llm.engine, llm.engine.ladder
    kv = eng.cache.geometry.kv_tokens
    assert eng.servable_context > kv  # auto on: a rung above
    lad.auto = False
    assert eng.servable_context == kv
    with pytest.raises(RequestError, match="the KV ladder's auto is off"):
        eng.add_request([65] * kv, SamplingParams(max_new_tokens=4))
    seq = eng.add_request([65] * (kv - 12), SamplingParams(max_new_tokens=3 * kv, temperature=0.0, ignore_eos=True))
    while not seq.is_finished:
        eng.step()
    assert seq.error is None and seq.finish_reason == "length" and len(seq.output_ids) == 12
    assert eng.cache.geometry.kv_tokens == kv
    lad.auto = True
    assert eng.servable_context > kv


def test_concurrent_requests_grow_the_ladder_instead_of_failing():
    """Issue 41, item 1: three requests at once (prompts of ~625, ~1,225 and ~1,825 tokens, 60 new each)
    on a ladder of 256-token steps. A grow for the first waiting request must also hold what the queue
    behind it holds (the rebuild's floor), else it is refused and a request fails; every one finishes."""
    llm, _ = make(ladder_step_size=256, max_running_requests=4)
    eng = llm.engine
    seqs = [eng.add_request([65 + i] * n, SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True))
            for i, n in enumerate((625, 1225, 1825))]
    for _ in range(2000):
        if all(s.is_finished for s in seqs):
            break
        eng.step()
    assert [(s.error, s.finish_reason, len(s.output_ids)) for s in seqs] == [(None, "length", 60)] * 3
    assert eng.cache.geometry.kv_tokens >= 1825 + 60
