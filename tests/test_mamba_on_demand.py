"""Device linear-attention state slots on demand (`--mamba-on-demand`, `ft.engine.sched.mamba_demand`) on the
demo model, offloaded under a small cache budget with the prefix cache's states in host memory: the pool
starts at one slot with the expert slots filling the rest, grows when requests wait for slots (the experts
shrink to what the budget leaves), shrinks back once a slot sits idle, and the tokens are those of an
engine with a fixed pool."""

from __future__ import annotations

import time

import pytest

from ft.engine import LLM, SamplingParams
from ft.engine.base.engine_config import MAMBA_ON_DEMAND_MIN
from ft.engine.sched import mamba_demand
from ft.errors import ConfigError

PROMPTS = [[5 + (i * 7 + j) % 11 for j in range(12 + i)] for i in range(4)]
OPTS = dict(cache_budget="12MiB", num_tokens=2048, max_prefill_length=256, max_running_requests=4,
            prefix_states_on_host=True)


class Clock:
    """Monotonic seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.t = time.monotonic()

    def __call__(self) -> float:
        return self.t


def run_all(llm, prompts, n=5):
    outs = llm.generate(prompt_token_ids=prompts, max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in outs]


def test_the_pool_grows_for_waiting_requests_and_shrinks_when_idle():
    fixed = LLM(**OPTS)
    llm = LLM(mamba_on_demand=True, **OPTS)
    e = llm.engine
    clock = Clock()
    e.mamba_demand.clock = clock
    start, base = e.cache.geometry, fixed.engine.cache.geometry
    assert start.mamba_slots == MAMBA_ON_DEMAND_MIN < base.mamba_slots == 4
    assert start.kv_tokens == base.kv_tokens and start.moe_slots > base.moe_slots  # the idle slots' bytes
    assert e.cache.ranges_around(moe=e.cache.expert_floor)["mamba"][1] >= 4  # every running request's slot, by
    # trading expert slots down to the floor

    assert run_all(llm, PROMPTS) == run_all(fixed, PROMPTS)  # four at once: one grow, to four slots
    grown = e.cache.geometry
    assert grown.mamba_slots == 4 and grown.moe_slots < start.moe_slots and e.mamba_demand.grows == 1
    entry = e.cache.history[-1]
    assert entry["trigger"] == "mamba" and entry["status"] == "ok" and "3 more" in entry["reason"]
    assert e.cache.layout.nbytes(grown) <= e.cache.budget.budget_bytes

    assert run_all(llm, PROMPTS[:1]) == run_all(fixed, PROMPTS[:1])  # too soon: the slots stay
    assert e.cache.geometry == grown
    clock.t += mamba_demand.IDLE_S
    assert run_all(llm, PROMPTS[1:2]) == run_all(fixed, PROMPTS[1:2])  # the step before it gives them back
    assert e.cache.geometry == start and e.mamba_demand.shrinks == 1
    assert e.cache.history[-1]["trigger"] == "mamba" and "unused" in e.cache.history[-1]["reason"]


def test_a_grow_that_fails_leaves_the_requests_waiting_and_served():
    """The grow's rebuild fails (rolled back): the requests run one at a time in the slot there is, with the
    fixed pool's tokens; the grow is tried again at that geometry only after IDLE_S."""
    fixed = LLM(**OPTS)
    llm = LLM(mamba_on_demand=True, **OPTS)
    e = llm.engine
    clock = Clock()
    e.mamba_demand.clock = clock
    start = e.cache.geometry
    e.cache.rebuilder.fault_at = "grow mamba"
    assert run_all(llm, PROMPTS[:3]) == run_all(fixed, PROMPTS[:3])
    assert e.cache.geometry == start and e.mamba_demand.grows == 0
    assert [h["status"] for h in e.cache.history if h["trigger"] == "mamba"] == ["rolled_back"]
    e.cache.rebuilder.fault_at = None
    clock.t += mamba_demand.IDLE_S - 1  # the same geometry, too soon: not tried again
    assert run_all(llm, PROMPTS[:2]) == run_all(fixed, PROMPTS[:2]) and e.mamba_demand.grows == 0
    clock.t += 1
    assert run_all(llm, PROMPTS[:2]) == run_all(fixed, PROMPTS[:2]) and e.mamba_demand.grows == 1
    assert e.cache.geometry.mamba_slots == 2


def test_the_warm_up_ends_with_the_pool_at_its_minimum():
    from ft.engine.core.warmup import warm_up

    e = LLM(mamba_on_demand=True, **OPTS).engine
    warm_up(e)
    assert e.mamba_demand.grows >= 1 and e.cache.geometry.mamba_slots == MAMBA_ON_DEMAND_MIN
    assert e.cache.history[-1]["trigger"] == "mamba" and "warm-up" in e.cache.history[-1]["reason"]


def test_the_banner_says_so():
    from ft.serve_cmd import describe

    banner = describe(LLM(mamba_on_demand=True, **OPTS).engine, "http://x")
    assert "linear-attention slots on demand: 1 now" in banner and "up to 4" in banner
    assert "on demand" not in describe(LLM(**OPTS).engine, "http://x")


def test_the_admin_state_ft_ctl_and_ft_top_say_so():
    from ft.ctl.format import format_cache
    from ft.engine.core.admin import cache_state
    from ft.tui.state import pool_usage

    state = cache_state(LLM(mamba_on_demand=True, **OPTS).engine, "serving", "demo")
    assert state.pools.mamba.on_demand_max == 4 and state.pools.mamba.size == 1
    assert "slots on demand, grown for waiting requests up to 4" in format_cache(state)
    assert pool_usage(state)["mamba"].endswith("(<= 4)")
    fixed = cache_state(LLM(**OPTS).engine, "serving", "demo")
    assert fixed.pools.mamba.on_demand_max == 0 and "on demand" not in format_cache(fixed)


def test_a_manual_mamba_size_is_a_409_while_the_pool_is_on_demand():
    """`ft ctl cache --mamba N` would be undone by the pool's next grow or shrink: refused with a line that
    says why (dry runs too), nothing touched; moe and kv still resize."""
    from inproc_server import AUTH, demo_app

    with demo_app(engine_kw=dict(mamba_on_demand=True, **OPTS)) as (client, state):
        before = client.get("/admin/cache", headers=AUTH).json()
        for body in ({"mamba": 2}, {"mamba": 2, "dry_run": True}, {"moe": 8, "mamba": 1}):
            r = client.post("/admin/cache", json=body, headers=AUTH)
            assert r.status_code == 409 and "--mamba-on-demand" in r.json()["error"]["message"], r.text
        after = client.get("/admin/cache", headers=AUTH).json()
        assert after["pools"] == before["pools"]
        r = client.post("/admin/cache", json={"kv": after["pools"]["kv"]["size"], "dry_run": True}, headers=AUTH)
        assert r.status_code == 200, r.text


def test_mamba_on_demand_is_refused_where_it_cannot_trade():
    for bad in ({"moe_backend": "resident"}, {"moe_cache_size": 8}, {"mamba_cache_size": 4},
                {"prefix_states_on_host": False}):
        with pytest.raises(ConfigError, match="--mamba-on-demand"):
            LLM(mamba_on_demand=True, cache_budget="12MiB", **bad)
    with pytest.raises(ConfigError, match="--mamba-on-demand"):  # the CPU keeps prefix states on the device by default
        LLM(mamba_on_demand=True, cache_budget="12MiB")
    e = LLM(mamba_on_demand=True, cache_budget="12MiB", enable_prefix_cache=False).engine  # no prefix cache: fine
    assert e.cache.geometry.mamba_slots == MAMBA_ON_DEMAND_MIN


def test_with_the_loan_a_grow_recalls_it_and_it_goes_out_again_beside_the_grown_pool(monkeypatch):
    import ft.engine.ranks.rank_state as rank_state

    monkeypatch.setattr(rank_state, "LOAN_KEEP_TOKENS", 32)  # (the real one, 2,048, is past the demo's chunk)
    fixed = LLM(**OPTS)
    llm = LLM(mamba_on_demand=True, lend_prefill_reserve=True, loan_hold_s=2.0, **OPTS)  # (a hold: to see the grow)
    e = llm.engine
    clock = Clock()
    e.mamba_demand.clock = e.loan.clock = clock
    assert e.cache.lent and e.cache.geometry.mamba_slots == 1
    assert run_all(llm, PROMPTS) == run_all(fixed, PROMPTS)
    g = e.cache.geometry
    assert g.mamba_slots == 4 and [h["trigger"] for h in e.cache.history[-2:]] == ["loan", "mamba"]
    clock.t += e.loan.hold_s
    assert run_all(llm, PROMPTS[:1]) == run_all(fixed, PROMPTS[:1])
    assert e.cache.lent and e.cache.geometry.mamba_slots == 4 and e.cache.geometry.moe_slots > g.moe_slots
    assert e.cache.layout.nbytes(e.cache.geometry) <= e.cache.budget.budget_bytes + e.loan_bytes


def test_n_choices_grow_the_pool_before_their_fork():
    """A request with n = 3 choices: its siblings wait outside the scheduler for the parent's first token; the
    pool grows for them before it, so each forks (the prompt computed once) with the fixed pool's tokens."""
    fixed = LLM(**OPTS)
    llm = LLM(mamba_on_demand=True, **OPTS)
    params = [SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)] * 3
    outs = []
    for engine_llm in (fixed, llm):
        e = engine_llm.engine
        seqs = e.add_request_group(PROMPTS[3], params)
        e.run_until_done(seqs, timeout_s=60)
        outs.append(([s.output_ids for s in seqs], e.counters["prompt_tokens"]))
    assert outs[1] == outs[0] and outs[0][1] == len(PROMPTS[3])  # one prompt prefill for three choices
    assert llm.engine.cache.geometry.mamba_slots == 3 and llm.engine.mamba_demand.grows == 1


def test_the_pools_stay_within_the_budget_as_requests_come_and_go_with_the_ladder_and_the_loan(monkeypatch):
    """Mamba on demand beside the KV ladder and the loan, under waves of requests of mixed lengths (some past the
    first rung, some over the kept chunk, some sharing a cached prefix, some with three choices, one aborted):
    after every step the pools' bytes fit the budget plus what is lent and every running request holds its slot;
    every request's tokens are those of an engine with none of the three trades. (Its first version found two
    bugs: a loan's recall refused for the KV a waiting prompt needed, and a prompt mid-prefill in a decode step.)"""
    import random

    import ft.engine.ranks.rank_state as rank_state

    monkeypatch.setattr(rank_state, "LOAN_KEEP_TOKENS", 32)
    base = dict(cache_budget="24MiB", max_prefill_length=256, max_running_requests=4, prefix_states_on_host=True)
    fixed = LLM(num_tokens=4096, **base)
    llm = LLM(mamba_on_demand=True, lend_prefill_reserve=True, enable_kv_ladder=True, ladder_step_size=512, **base)
    e = llm.engine
    clock = Clock()
    e.mamba_demand.clock = e.loan.clock = clock
    rng = random.Random(7)
    shared = [5 + rng.randrange(200) for _ in range(150)]
    for wave in range(4):
        pairs = []
        for _ in range(rng.randint(1, 4)):
            prompt = (shared[: rng.choice((64, 150))] if rng.random() < 0.4 else []) + \
                [5 + rng.randrange(200) for _ in range(rng.choice((8, 20, 100, 300, 1100)))]
            params = [SamplingParams(max_new_tokens=rng.choice((4, 12)), temperature=0.0, ignore_eos=True)]
            params *= rng.choice((1, 1, 3))
            pairs.append((e.add_request_group(prompt, params), fixed.engine.add_request_group(prompt, params)))
        aborted = pairs[0][0][0] if wave == 2 else None
        steps = 0
        while e.has_work:
            e.step()
            steps += 1
            if aborted is not None and steps == 3:
                e.abort(aborted.request_id)
            g, c = e.cache.geometry, e.cache
            assert c.layout.nbytes(g) <= c.budget.budget_bytes + c.lent, (g, c.lent)
            assert all(s.mamba_slot is not None and s.mamba_slot < g.mamba_slots for s in e.scheduler.running)
        for got, want in pairs:
            fixed.engine.run_until_done(want, timeout_s=60)
            for a, b in zip(got, want):
                if a is not aborted:
                    assert a.error is None and a.output_ids == b.output_ids, (wave, len(a.prompt_ids), a.error)
        clock.t += max(mamba_demand.IDLE_S, e.loan.hold_s)
    triggers = {h["trigger"] for h in e.cache.history}
    assert {"mamba", "loan", "ladder"} <= triggers and e.mamba_demand.grows >= 1 and e.mamba_demand.shrinks >= 1
