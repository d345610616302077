"""The prefill reserve's loan to the expert slots (`--lend-prefill-reserve`, `ft.engine.sched.loan`) on the
demo model, offloaded under a small cache budget: lent at startup, recalled by a step longer than the
kept chunk, lent again once no long prompt is pending; every other resize recalls it first; the
advertised ranges are the budget's alone; greedy tokens are those of an engine without the loan."""

from __future__ import annotations

import time

import pytest

import ft.engine.ranks.rank_state as rank_state
from ft.engine import LLM
from ft.errors import ConfigError

KEEP = 32
SHORT = [5 + i % 7 for i in range(20)]
LONG = list(range(10, 110))  # 100 tokens: more than KEEP, less than the chunk (256): a partial recall
WHOLE = [5 + i % 200 for i in range(300)]  # a first chunk of 256 tokens: the whole reserve, the whole loan
HOLD = 2.0  # a hold to see (the default, 0, lends at the first plain step)


@pytest.fixture(autouse=True)
def keep_small(monkeypatch):
    monkeypatch.setattr(rank_state, "LOAN_KEEP_TOKENS", KEEP)  # (the real one, 2,048, is past the demo's chunk)


class Clock:
    """Monotonic seconds that move only when a test moves them (from now: the startup lend read the real clock)."""

    def __init__(self) -> None:
        self.t = time.monotonic()

    def __call__(self) -> float:
        return self.t


def make(**opts):
    return LLM(cache_budget="12MiB", max_prefill_length=256, max_running_requests=2, **opts)


def greedy(llm, prompt, n=6):
    return llm.generate(prompt_token_ids=[prompt], max_new_tokens=n, temperature=0.0, ignore_eos=True)[0].token_ids


def test_lent_at_startup_recalled_by_a_long_step_and_lent_again():
    plain = make()
    llm = make(lend_prefill_reserve=True, loan_hold_s=HOLD)
    e = llm.engine
    clock = Clock()
    e.loan.clock = clock
    base, slot = plain.engine.cache.geometry, e.cache.layout.unit_costs().expert_slot
    g = e.cache.geometry
    assert e.cache.lent == e.loan_bytes > slot and e.cache.loan_bytes == e.loan_bytes
    assert (g.kv_tokens, g.mamba_slots) == (base.kv_tokens, base.mamba_slots) and g.moe_slots > base.moe_slots
    assert e.cache.layout.nbytes(g) <= e.cache.budget.budget_bytes + e.loan_bytes
    assert e.cache.history[-1]["trigger"] == "loan" and e.cache.history[-1]["status"] == "ok"
    assert e.cache.reachable_ranges() == plain.engine.cache.reachable_ranges()  # the budget's alone
    assert greedy(llm, SHORT) == greedy(plain, SHORT) and e.cache.lent  # a short prompt keeps it out
    assert greedy(llm, WHOLE) == greedy(plain, WHOLE)
    assert not e.cache.lent and e.cache.geometry == base and e.loan.recalls == 1
    recall = e.cache.history[-1]
    assert recall["trigger"] == "loan" and "256 tokens" in recall["reason"] and recall["to"]["moe"] == base.moe_slots
    greedy(llm, SHORT)  # too soon after the long step: not lent yet
    assert not e.cache.lent
    clock.t += e.loan.hold_s
    assert greedy(llm, SHORT) == greedy(plain, SHORT) and e.cache.lent and e.cache.geometry == g


def test_a_hold_of_zero_lends_at_the_first_plain_step_after_the_long_prompt():
    llm = make(lend_prefill_reserve=True)
    assert llm.engine.loan.hold_s == 0.0  # the default (session 46: the decode after a long prompt gains 3%)
    e = llm.engine
    e.loan.clock = Clock()  # frozen: only the hold of 0 lets the loan out again
    lent = e.cache.lent
    out = llm.generate(prompt_token_ids=[WHOLE], max_new_tokens=4, temperature=0.0, ignore_eos=True)[0]
    assert e.loan.recalls == 1 and len(out.token_ids) == 4
    assert e.cache.lent == lent  # the decode after the long prompt lent it again at its first plain step
    assert [h["trigger"] for h in e.cache.history[-2:]] == ["loan", "loan"]
    with pytest.raises(ConfigError, match="hold"):
        make(lend_prefill_reserve=True, loan_hold_s=-1.0)


def test_a_step_between_the_kept_and_the_whole_chunk_recalls_only_what_it_needs():
    """A 100-token step on a 256-token chunk's reserve gives back what its activations need and leaves the rest
    lent (`RankState.loan_beside`); the whole loan goes out again once due."""
    plain = make()
    llm = make(lend_prefill_reserve=True, loan_hold_s=HOLD)
    e = llm.engine
    clock = Clock()
    e.loan.clock = clock
    lent_geometry, base = e.cache.geometry, plain.engine.cache.geometry
    keep = e.loan_beside(len(LONG))
    assert e.loan_beside(KEEP) == e.loan_bytes and e.loan_beside(256) == 0 and 0 < keep < e.loan_bytes
    assert greedy(llm, LONG) == greedy(plain, LONG)
    g = e.cache.geometry
    assert e.cache.lent == keep and base.moe_slots < g.moe_slots < lent_geometry.moe_slots and e.loan.recalls == 1
    assert e.cache.layout.nbytes(g) <= e.cache.budget.budget_bytes + keep
    assert e.cache.history[-1]["trigger"] == "loan" and "100 tokens" in e.cache.history[-1]["reason"]
    assert greedy(llm, LONG) == greedy(plain, LONG) and e.loan.recalls == 1  # what is left out stays out
    clock.t += e.loan.hold_s
    assert greedy(llm, SHORT) == greedy(plain, SHORT) and e.cache.lent == e.loan_bytes
    assert e.cache.geometry == lent_geometry


def test_a_resize_while_lent_starts_from_the_budget_alone():
    """A user's resize while the loan is out recalls it first and lands on exactly what was asked; the
    loan then stays in while the expert slots are not at the budget's fill (a user's own size)."""
    llm = make(lend_prefill_reserve=True)
    e = llm.engine
    e.loan.clock = Clock()
    lent = e.cache.geometry
    kv = e.cache.target(kv=e.cache.geometry.kv_tokens // 2).kv_tokens  # (whole pages)
    entry = e.cache.rebuild(kv=kv)
    assert entry["status"] == "ok" and not e.cache.lent
    assert [h["trigger"] for h in e.cache.history[-2:]] == ["loan", "manual"]
    g = e.cache.geometry
    assert g.kv_tokens == kv and g.moe_slots < lent.moe_slots  # (the experts did not follow the freed KV)
    e.loan.clock.t += e.loan.hold_s
    greedy(llm, SHORT)
    assert not e.cache.lent and e.cache.geometry == g  # not at the budget's fill: no loan
    fill = e.cache.moe_beside(kv)
    e.cache.rebuild(moe=fill)
    e.loan.clock.t += e.loan.hold_s
    greedy(llm, SHORT)
    assert e.cache.lent and e.cache.geometry.moe_slots > fill


def test_the_loan_is_shown_and_refused_where_it_cannot_apply():
    from ft.serve_cmd import describe

    llm = make(lend_prefill_reserve=True)
    banner = describe(llm.engine, "http://x")
    assert "prefill reserve:" in banner and "lent now" in banner and "--no-lend-prefill-reserve" in banner
    assert "lent again at the first step after the last (--loan-hold-s;" in banner
    assert "lent again 2 s after the last (--loan-hold-s;" in describe(make(lend_prefill_reserve=True,
                                                                             loan_hold_s=HOLD).engine, "http://x")
    assert "prefill reserve:" not in describe(make().engine, "http://x")
    # the admin API's cache state, `ft ctl cache`, `ft top`'s pools, and the history entries' trigger
    from ft.ctl.format import format_cache
    from ft.engine.core.admin import cache_state, history
    from ft.tui.state import pool_usage

    state = cache_state(llm.engine, "serving", "demo")
    assert state.pools.moe.lent_bytes == state.pools.moe.loan_bytes == llm.engine.loan_bytes > 0
    assert "the prefill reserve lends them up to" in format_cache(state) and "lent now" in format_cache(state)
    assert "lent" in pool_usage(state)["moe"]
    assert "loan" in [h.trigger for h in history(llm.engine).entries]
    for bad in ({"moe_backend": "resident"}, {"moe_cache_size": 8}):
        with pytest.raises(ConfigError, match="--lend-prefill-reserve"):
            LLM(lend_prefill_reserve=True, **bad)


def test_the_loan_is_the_default_where_it_can_lend():
    """Unasked, the slots borrow the reserve where an offloaded cache fills the budget on one CUDA GPU (the
    H200's +2-3%, bench/RESULTS.md session 35), and nowhere else; asked either way, as asked."""
    from ft.engine.base.engine_config import EngineConfig

    assert EngineConfig().lends_reserve("cuda") and not EngineConfig().lends_reserve("cpu")
    for other in ({"moe_backend": "resident"}, {"moe_cache_size": 8}, {"tensor_parallel_size": 2}):
        assert not EngineConfig(**other).lends_reserve("cuda")
    assert not EngineConfig(lend_prefill_reserve=False).lends_reserve("cuda")
    assert EngineConfig(lend_prefill_reserve=True).lends_reserve("cpu")
    assert make().engine.loan is None and make(lend_prefill_reserve=True).engine.loan is not None  # CPU: as asked


def test_a_failed_lend_or_recall_leaves_the_server_serving():
    """A lend whose grow fails rolls back (recorded, not raised: the budget's geometry serves on); a recall
    whose shrink fails leaves the loan out, is logged, and the step runs anyway; no loan is made again."""
    plain = make()
    llm = make(lend_prefill_reserve=True)
    e = llm.engine
    clock = Clock()
    e.loan.clock = clock
    lent = e.cache.geometry
    e.cache.rebuilder.fault_at = "shrink moe"
    assert greedy(llm, LONG) == greedy(plain, LONG)
    assert e.loan.failed and e.cache.lent and e.cache.geometry == lent and e.cache.degraded is None
    assert e.cache.history[-1]["status"] == "rolled_back"
    e.cache.rebuilder.fault_at = None
    clock.t += e.loan.hold_s
    assert not e.loan.due()
    fresh = make(lend_prefill_reserve=True).engine
    fresh.cache.recall("test")
    base = fresh.cache.geometry
    fresh.cache.rebuilder.fault_at = "grow moe"
    entry = fresh.loan.lend()
    assert entry["status"] == "rolled_back" and not fresh.cache.lent and fresh.cache.geometry == base


def test_the_warm_up_ends_with_the_loan_out():
    """The warm-up's long prompts recall the loan; it is out again before the server says ready, so
    the first request's step makes no rebuild."""
    from ft.engine.core.warmup import warm_up

    e = make(lend_prefill_reserve=True).engine
    warm_up(e)
    assert e.loan.recalls >= 1 and e.cache.lent == e.loan_bytes and e.cache.history[-1]["trigger"] == "loan"


def test_a_ladder_move_while_lent_recalls_first_and_lends_again_at_the_new_rung():
    """With the KV ladder: a request that needs a higher rung while the loan is out recalls it, moves, and the
    loan goes out again beside the new rung's KV once due; the rung and the first tokens are the no-loan
    engine's."""
    from ft.engine import SamplingParams

    ladder = dict(enable_kv_ladder=True, ladder_step_size=256, cache_budget="20MiB", max_prefill_length=256,
                  max_running_requests=1)
    plain = LLM(**ladder)
    llm = LLM(lend_prefill_reserve=True, loan_hold_s=HOLD, **ladder)
    e = llm.engine
    clock = Clock()
    e.loan.clock = clock
    assert e.cache.lent

    def first_tokens(eng, n=8):  # a request planned past the first rung (512): the ladder grows at admission
        seq = eng.add_request(SHORT, SamplingParams(max_new_tokens=700, temperature=0.0, ignore_eos=True))
        while len(seq.output_ids) < n:
            eng.step()
        eng.abort(seq.request_id)
        eng.step()
        return list(seq.output_ids[:n])

    assert first_tokens(e) == first_tokens(plain.engine)
    assert e.cache.geometry.kv_tokens == plain.engine.cache.geometry.kv_tokens > e.ladder.rungs[0]
    triggers = [h["trigger"] for h in e.cache.history]
    assert triggers[-2:] == ["loan", "ladder"] and not e.cache.lent  # recalled just before the move
    clock.t += e.loan.hold_s
    greedy(llm, SHORT, n=2)
    g = e.cache.geometry
    assert e.cache.lent and g.moe_slots == e.cache.moe_beside(g.kv_tokens, e.cache.loan_bytes)


def test_a_prompt_past_the_rung_while_lent_is_served():
    """A prompt longer than the current KV rung arrives while the loan is out: the ladder's grow recalls the loan
    first, and that recall (experts alone) must not be refused for the KV the prompt will need (the planner
    checked every pool against its floor: the request was rejected, "the KV ladder could not grow")."""
    ladder = dict(enable_kv_ladder=True, ladder_step_size=256, cache_budget="20MiB", max_prefill_length=256,
                  max_running_requests=1)
    plain = LLM(**ladder)
    llm = LLM(lend_prefill_reserve=True, loan_hold_s=HOLD, **ladder)
    e = llm.engine
    assert e.cache.lent and e.cache.geometry.kv_tokens == e.ladder.rungs[0] == 512
    prompt = [5 + i % 200 for i in range(600)]  # past the first rung
    got, want = greedy(llm, prompt, n=4), greedy(plain, prompt, n=4)
    assert got == want and len(got) == 4
    assert [h["trigger"] for h in e.cache.history[-2:]] == ["loan", "ladder"]
