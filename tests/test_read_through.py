"""The expert cache's read-through mode (offloaded decode inside the graph), on the CPU: the host
policy against the lookup reference, replayed on routing traces."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ft.kernels.expert_lookup import expert_lookup_ref
from ft.memory.read_through import LANDING_MARGIN
from ft.tools.offload_sim import read_through_cache, read_through_hit_rate, replay_step
from ft.tools.routing_trace import RoutingTrace, lru_hit_rate


def _check_consistent(cache):
    """slot_table, its host twin, the LRU map, the free list, the landing reserves and the spares
    agree, and no slot is in two places."""
    table = cache.slot_table.numpy()
    assert np.array_equal(table, cache.table_np)
    mapped = {(int(l_), int(e)): int(table[l_, e]) for l_, e in zip(*np.nonzero(table >= 0))}
    assert mapped == cache.resident_slots()
    rt = cache.read_through
    landing = [s for slots in rt.landing + rt.spare for s in slots if s not in rt._owner]  # (owned: mapped)
    assert all(mapped.get(key) == slot for slot, key in rt._owner.items())
    owners = list(mapped.values()) + list(cache._free) + landing
    assert len(owners) == len(set(owners)) and set(owners) <= set(range(cache.num_slots))
    assert len(owners) == cache.num_slots


def test_a_miss_lands_in_a_reserved_slot_and_hits_from_the_next_step_on():
    cache = read_through_cache(2, 8, 6, 2)
    rt = cache.read_through
    replay_step(cache, [[[0, 1], [2, 3]]])  # cold: every pair misses; landing reserves were 2 per layer
    cache.collect()
    assert cache.stats.misses == 4 and cache.stats.hits == 0
    assert all(cache.is_resident(layer, e) for layer, e in [(0, 0), (0, 1), (1, 2), (1, 3)])
    _check_consistent(cache)
    replay_step(cache, [[[0, 1], [2, 3]]])
    cache.collect()
    assert cache.stats.hits == 4 and cache.stats.misses == 4
    assert rt.landed_total == 4 and cache.stats.bytes_loaded == 4 * cache.bytes_per_slot
    _check_consistent(cache)


def test_victims_are_never_used_by_the_last_step_and_layers_keep_their_floor():
    cache = read_through_cache(2, 64, 10, 3)
    rt = cache.read_through
    rt.floor = 2
    trace = RoutingTrace(2, 64, 3, seed=3).tokens(60)
    evictions = 0
    for tok in trace:
        before = set(cache.resident_slots())
        counts_before = (cache.table_np >= 0).sum(axis=1)
        used_last = rt.used_last.copy()
        replay_step(cache, [tok])  # begin_step evicts; the landed experts are mapped by the collect below
        evicted = before - set(cache.resident_slots())
        assert all(not used_last[key] for key in evicted)
        counts = (cache.table_np >= 0).sum(axis=1)
        assert all(c >= min(rt.floor, c0) for c, c0 in zip(counts.tolist(), counts_before.tolist()))
        evictions += len(evicted)
        cache.collect()
        _check_consistent(cache)
        assert all(len(slots) <= min(rt.capacity, 3) for slots in rt.landing)
    assert cache.stats.hits > 0 and evictions > 20


def test_more_misses_than_landing_slots_are_computed_but_not_cached():
    cache = read_through_cache(1, 32, 4, 4)
    rt = cache.read_through
    replay_step(cache, [[[0, 1, 2, 3]], [[4, 5, 6, 7]]])  # 2 rows: 8 misses, at most 4 landing slots
    cache.collect()
    assert cache.stats.misses == 8 and rt.landed_total <= 4 and cache.num_resident == rt.landed_total
    _check_consistent(cache)


def test_reserve_follows_the_last_steps_misses():
    cache = read_through_cache(1, 32, 16, 4)
    rt = cache.read_through
    replay_step(cache, [[[0, 1, 2, 3]]])
    cache.collect()
    assert rt.misses_last.tolist() == [4]
    rt.begin_step(1, 4)
    assert len(rt.landing[0]) == min(4, 4 + LANDING_MARGIN)
    rt.end_step()
    cache.collect()  # a step without lookups: nothing used, nothing missed
    rt.begin_step(1, 4)
    assert len(rt.landing[0]) == LANDING_MARGIN


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_hit_rate_near_the_exact_lru_on_a_calibrated_trace(policy):
    """Read-through caches a miss one step later than the exact LRU and keeps landing slots aside:
    on a calibrated trace it stays within a few points of it (bench/offload_policy.py measures
    48 layers)."""
    layers, experts, k = 4, 128, 4
    trace = RoutingTrace(layers, experts, k, seed=7).tokens(300)
    slots = layers * experts // 4
    exact = lru_hit_rate(trace, slots, warmup=100)
    got = read_through_hit_rate(trace, slots, warmup=100, policy=policy)
    assert 0.5 < exact and exact - 0.06 < got <= exact + 0.06


def test_resize_and_invalidate_release_landing_slots():
    cache = read_through_cache(2, 16, 12, 2)
    rt = cache.read_through
    replay_step(cache, [[[0, 1], [2, 3]]])
    rt.begin_step(1, 2)  # reserves landing slots; the step is not run
    assert any(rt.landing)
    cache.resize(6)
    assert not any(rt.landing) and cache.num_slots == 6
    _check_consistent(cache)
    cache.invalidate()
    assert cache.num_resident == 0 and len(cache._free) == 6
    _check_consistent(cache)


def test_ensure_and_read_through_share_the_cache():
    """A prefill's ensure between decode steps: landed experts are collected first, nothing is
    mapped twice."""
    cache = read_through_cache(1, 16, 8, 2)
    replay_step(cache, [[[0, 1]]])
    cache.collect()
    cache.ensure(0, [1, 2, 3])
    _check_consistent(cache)
    replay_step(cache, [[[2, 5]]])
    cache.collect()
    _check_consistent(cache)
    assert cache.is_resident(0, 5)


def test_bad_policy():
    with pytest.raises(ValueError, match="lru, lfu"):
        read_through_cache(1, 4, 2, 1, policy="mru")


def test_lookup_reads_the_table_that_begin_step_wrote():
    """Victims are unmapped on the device before the step: the lookup sees -1 for them."""
    cache = read_through_cache(1, 8, 3, 1)
    for e in (0, 1, 2):  # fill the cache: 3 residents, no free slot
        replay_step(cache, [[[e]]])
    cache.collect()
    rt = cache.read_through
    rt.begin_step(1, 1)
    victims = [e for e in range(8) if cache.table_np[0, e] < 0]
    slots, _ = expert_lookup_ref(torch.tensor([[victims[0]]]), cache.slot_table, rt.book, 0)
    assert int(slots[0, 0]) == -1


# ------------------------------------------------------------------------------- the engine


def test_engine_read_through_decode_matches_resident_and_loads_before_each_layer(tiny_one):
    """Offloaded decode in read-through mode (the default): the same greedy tokens as the resident
    backend and as loading misses before each layer; misses land and later steps hit."""
    from tests.test_oracle import GREEDY_32, hf_greedy, make_llm, prompt_of

    _, model, path = tiny_one
    k = model.config.num_experts_per_tok
    prompts = [prompt_of(40, seed=71), prompt_of(9, seed=72)]
    resident = make_llm(path, moe_backend="resident").generate(prompt_token_ids=prompts, **GREEDY_32)
    slots = 3 * k
    through = make_llm(path, moe_backend="offload", moe_cache_size=slots)
    loads = make_llm(path, moe_backend="offload", moe_cache_size=slots, expert_read_through=False)
    assert through.engine.pools.experts.read_through is not None
    assert loads.engine.pools.experts.read_through is None
    got, want = (llm.generate(prompt_token_ids=prompts, **GREEDY_32) for llm in (through, loads))
    for r, a, b, p in zip(resident, got, want, prompts):
        assert a.token_ids == b.token_ids == r.token_ids == hf_greedy(model, p)
    cache = through.engine.pools.experts
    cache.collect()
    rt = cache.read_through
    assert rt.landed_total > 0 and cache.stats.hits > 0 and cache.stats.misses > 0
    assert rt.step > 0 and not rt.active


def test_lfu_policy_and_flags(tiny_one):
    from ft.errors import ConfigError
    from tests.test_oracle import GREEDY_32, make_llm, prompt_of

    _, model, path = tiny_one
    llm = make_llm(path, moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok,
                   expert_policy="lfu")
    assert llm.engine.pools.experts.read_through.policy == "lfu"
    llm.generate(prompt_token_ids=[prompt_of(12, seed=3)], **GREEDY_32)
    with pytest.raises(ConfigError, match="lfu"):
        make_llm(path, expert_policy="lfu", expert_read_through=False)
    with pytest.raises(ConfigError, match="auto, lru, lfu"):
        make_llm(path, expert_policy="fifo")
    # the default, auto: LFU when decode reads misses through, LRU when misses load before each layer
    auto = make_llm(path, moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok)
    assert auto.engine.config.expert_policy == "auto"
    assert auto.engine.pools.experts.policy == auto.engine.pools.experts.read_through.policy == "lfu"
    assert auto.engine.config.expert_mapped_victims is None and auto.engine.pools.experts.read_through.mapped_victims
    off = make_llm(path, moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok,
                   expert_mapped_victims=False)
    assert not off.engine.pools.experts.read_through.mapped_victims
    loads = make_llm(path, moe_backend="offload", moe_cache_size=2 * model.config.num_experts_per_tok,
                     expert_read_through=False)
    assert loads.engine.pools.experts.read_through is None and loads.engine.pools.experts.policy == "lru"


@pytest.mark.parametrize("seed", range(3))
def test_lfu_victims_follow_score_then_layer_then_expert_across_ties(seed):
    """The LFU's victims are the residents the last step did not use, in (aged score, layer, expert)
    order exactly, each layer kept at its floor. A few scores of 0 and a large tie at 1 (experts landed
    in one step and not used since, as after a cold start): the picks reach into the tie, which
    straddles the partial sort's first cut (4 n + 64 of ~700 candidates); before session 52 that cut
    kept an arbitrary part of the tie, so the victims were not the lowest layers' and experts'."""
    rng = np.random.default_rng(seed)
    layers, experts, n = 8, 128, 40
    cache = read_through_cache(layers, experts, 820, 4, "lfu")
    rt = cache.read_through
    for layer in range(layers):
        cache.ensure(layer, rng.permutation(experts)[:100].tolist(), count=False)
    rt.score[:] = np.where(rng.random((layers, experts)) < 0.03, 0.0, 1.0)
    rt.used_last = rng.random((layers, experts)) < 0.1
    rt.floor = 10
    resident = cache.table_np >= 0
    counts = resident.sum(axis=1).tolist()
    want = []
    for score, layer, e in sorted((float(rt.score[l_, e]), l_, e) for l_, e in zip(*np.nonzero(resident))
                                  if not rt.used_last[l_, e]):
        if len(want) < n and counts[layer] > rt.floor:
            counts[layer] -= 1
            want.append((layer, e))
    assert rt._victims(n) == want[::-1]  # (the best victim last)


def test_without_collects_between_steps_victims_avoid_the_step_before():
    """As the engine runs decode (no `collect` between steps; each `end_step` takes in the step
    before): a victim is never an expert the step just before used, also when a cache under
    pressure has too few spares and `begin_step` tops up (it collects that step first)."""
    cache = read_through_cache(2, 32, 14, 3, rows=2)
    rt = cache.read_through
    rt.floor = 1
    trace = RoutingTrace(2, 32, 3, seed=11).tokens(120)
    used_before: set = set()
    topped_up = 0
    for t in range(0, len(trace) - 1, 2):
        rows = [trace[t], trace[t + 1]]
        short = any(len(s) < 1 for s in rt.spare)
        before = set(cache.resident_slots())
        rt.begin_step(2, 3)
        evicted = before - set(cache.resident_slots())
        assert not evicted & used_before, (t, evicted & used_before)
        topped_up += short and bool(evicted)
        for layer in range(cache.num_layers):
            ids = torch.tensor([row[layer] for row in rows], dtype=torch.int64)
            expert_lookup_ref(ids, cache.slot_table, rt.book, layer)
        before = set(cache.resident_slots())
        used_now = {(layer, e) for row in rows for layer, ids in enumerate(row) for e in ids}
        rt.end_step()  # collects the step before, then picks victims: never the step before's experts
        assert not (before - set(cache.resident_slots())) & used_before
        used_before = used_now
    cache.collect()
    _check_consistent(cache)
    assert topped_up > 0 and cache.stats.hits > 0


def test_begin_step_uploads_what_end_step_staged():
    """The book's step, claim counters and landing table are views of one tensor, uploaded by
    begin_step in one copy; end_step stages the next table (double-buffered), begin_step restages
    only when it changed the reserve. After each begin_step the book holds exactly this step's."""
    cache = read_through_cache(3, 32, 20, 2, rows=2)
    rt = cache.read_through
    base = rt._inputs.data_ptr()
    assert {rt.book.step.data_ptr(), rt.book.landing_used.data_ptr(), rt.book.landing.data_ptr()} <= set(
        range(base, base + rt._inputs.numel() * 4))
    trace = RoutingTrace(3, 32, 2, seed=5).tokens(40)
    for t in range(0, 40, 2):
        rows = [trace[t], trace[t + 1]]
        rt.begin_step(2, 2)
        assert rt.book.step.tolist() == [rt.step, 2] and rt.book.landing_used.tolist() == [0, 0, 0]
        for layer, slots in enumerate(rt.landing):
            row = rt.book.landing[layer].tolist()
            assert row[: len(slots)] == slots and all(v == -1 for v in row[len(slots):])
        for layer in range(cache.num_layers):
            ids = torch.tensor([row[layer] for row in rows], dtype=torch.int64)
            expert_lookup_ref(ids, cache.slot_table, rt.book, layer)
        rt.end_step()
    cache.collect()
    _check_consistent(cache)


def test_staging_ring_keeps_each_load_and_grows():
    """The victims' staging (`_Staging`): each load's pairs reach the device as given, while the
    host writes the next loads into other buffers of the ring (RING loads before one is reused, so
    the host never waits for a copy queued after the step in flight); a load larger than the
    buffers grows them."""
    import torch

    from ft.memory.read_through import _Staging

    st = _Staging(torch.device("cpu"))
    outs = []
    for k in range(2 * _Staging.RING + 1):
        idx, val = st.load([k, k + 1, k + 2], [10 * k, 10 * k + 1, 10 * k + 2])
        outs.append((idx.tolist(), val.tolist()))
        assert st._next == (k + 1) % _Staging.RING
    assert outs[-1] == ([8, 9, 10], [80, 81, 82])
    big = list(range(300))
    idx, val = st.load(big, [-v for v in big])
    assert idx.tolist() == big and val.tolist() == [-v for v in big] and st.dev.shape[1] >= 300
    assert len(st.host) == _Staging.RING and all(h.shape == st.dev.shape for h in st.host)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_mapped_victims_stay_hits_until_claimed(policy):
    """`mapped_victims`: a victim keeps its slot mapped until a miss claims it. Over a calibrated trace
    the table never maps two experts to one slot, host and device agree after each collect, the
    reserved victims are still resident, and the hit rate is at least the unmapped reserve's."""
    trace = RoutingTrace(6, 64, 4, seed=9).tokens(150)
    cache = read_through_cache(6, 64, 60, 4, policy, mapped_victims=True)
    for tok in trace:
        replay_step(cache, [tok])
        table = cache.slot_table.numpy()
        live = table[table >= 0]
        assert len(live) == len(set(live.tolist()))
        cache.collect()
        _check_consistent(cache)
    rt = cache.read_through
    assert rt._owner and rt.landed_total > 0
    mapped = read_through_hit_rate(trace, 60, warmup=50, policy=policy, mapped_victims=True)
    unmapped = read_through_hit_rate(trace, 60, warmup=50, policy=policy)
    assert mapped >= unmapped, (mapped, unmapped)


def test_engine_decode_with_mapped_victims_matches_resident(tiny_one):
    from ft.errors import ConfigError
    from tests.test_oracle import GREEDY_32, make_llm, prompt_of

    _, model, path = tiny_one
    k = model.config.num_experts_per_tok
    prompts = [prompt_of(40, seed=71), prompt_of(9, seed=72)]
    resident = make_llm(path, moe_backend="resident").generate(prompt_token_ids=prompts, **GREEDY_32)
    llm = make_llm(path, moe_backend="offload", moe_cache_size=3 * k, expert_mapped_victims=True)
    rt = llm.engine.pools.experts.read_through
    assert rt.mapped_victims
    owned = []
    stage = rt._stage
    rt._stage = lambda lists: owned.append(len(rt._owner)) or stage(lists)  # victims reserved while mapped
    got = llm.generate(prompt_token_ids=prompts, **GREEDY_32)
    assert max(owned) > 0
    assert [g.token_ids for g in got] == [r.token_ids for r in resident]
    llm.engine.pools.experts.collect()
    assert rt.landed_total > 0
    with pytest.raises(ConfigError, match="mapped-victims"):
        make_llm(path, expert_mapped_victims=True, expert_read_through=False)


def test_mapped_victims_through_ensure_resize_and_invalidate():
    """With victims reserved while still mapped: a prefill's `ensure` that needs their slots, a shrink
    that cuts some of them and an invalidation leave every slot in one place, and decode goes on."""
    trace = RoutingTrace(3, 32, 3, seed=4).tokens(60)
    cache = read_through_cache(3, 32, 24, 3, "lfu", mapped_victims=True)
    rt = cache.read_through

    def run(tokens):
        for tok in tokens:
            replay_step(cache, [tok])
        rt.begin_step(1, 3)  # a reserve for a step that is not run (as before a prefill)

    run(trace[:20])
    assert rt._owner  # victims reserved, still mapped
    cache.collect()
    cache.ensure(0, list(range(12)))  # more than the free slots: the reserves go first, then LRU residents
    _check_consistent(cache)
    assert all(cache.is_resident(0, e) for e in range(12))
    rt.end_step()
    run(trace[20:40])
    assert rt._owner
    cache.resize(15)
    _check_consistent(cache)
    run(trace[40:])
    cache.collect()
    _check_consistent(cache)
    cache.invalidate()
    assert cache.num_resident == 0 and not rt._owner and len(cache._free) == 15


def test_the_startup_banner_says_how_decode_gets_its_experts(tiny_one):
    from ft.serve_cmd import describe
    from tests.test_oracle import make_llm

    _, model, path = tiny_one
    slots = 3 * model.config.num_experts_per_tok

    def line(**opts):
        text = describe(make_llm(path, **opts).engine, "http://x")
        return next((x for x in text.splitlines() if x.startswith("  decode:")), None)

    assert line(moe_backend="offload", moe_cache_size=slots) == (  # mapped victims by default
        "  decode: misses read from host memory inside the step and cached as they land (read-through); "
        "victims by lfu (--expert-policy auto); a victim stays a hit until a miss claims its slot")
    assert line(moe_backend="offload", moe_cache_size=slots, expert_mapped_victims=False).endswith(
        "victims by lfu (--expert-policy auto)")
    assert line(moe_backend="offload", moe_cache_size=slots, expert_read_through=False) == (
        "  decode: a layer's missing experts load into the cache before it runs; victims by lru (--expert-policy auto)")
    assert line(moe_backend="resident") is None
    text = describe(make_llm(path, prefix_states_on_host=True).engine, "http://x")
    assert "  prefix cache: up to 4 entries keep their linear-attention state (" in text
    assert "prefix cache:" not in describe(make_llm(path).engine, "http://x")  # the CPU's default: off


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_shrink_keeps_the_hottest_experts_with_their_bytes(policy):
    """`ExpertCache.resize` to fewer slots moves the hottest residents of the cut slots into the kept
    slots of colder ones (LFU: aged use counts; LRU: recency) before it cuts, so the shrink forgets the
    coldest; the moved slots hold their experts' bytes and the tables agree."""
    from ft.memory.expert_cache import ExpertCache
    from ft.kernels.moe import SlotWeights

    gen = torch.Generator().manual_seed(4)
    host = SlotWeights(torch.randn(1, 16, 3, generator=gen), torch.randn(1, 16, 2, generator=gen))
    cache = ExpertCache(host, 16, torch.device("cpu"))
    cache.enable_read_through(4, policy)
    cache.MOVE_BYTES = 3 * 3 * 4  # (several batches of three slots: the widest slot row is 3 floats)
    # steps that use experts 0..11 once (they land in the high slots first), then 6..11 again, hottest last
    replay_step(cache, [[[0, 1, 2, 3]]])
    replay_step(cache, [[[4, 5, 6, 7]]])
    replay_step(cache, [[[8, 9, 10, 11]]])
    for _ in range(3):
        replay_step(cache, [[[6, 7, 8, 9]]])
    replay_step(cache, [[[10, 11, 8, 9]]])
    cache.collect()
    assert cache.num_resident >= 6
    heat = cache.heat()
    hottest = sorted(heat, key=lambda k: -heat[k])[:6]
    assert any(cache.slot_of(k) >= 6 for k in hottest)  # (some must move)
    for (layer, expert), slot in cache.resident_slots().items():  # (the replay maps landings; the MoE kernel writes bytes)
        for t, h in zip(cache.slots, host):
            if t is not None:
                t[slot] = h[layer, expert]
    cache.resize(6)
    _check_consistent(cache)
    assert sorted(cache.resident_slots()) == sorted(hottest)
    for (layer, expert), slot in cache.resident_slots().items():
        assert all(torch.equal(t[slot], h[layer, expert]) for t, h in zip(cache.slots, host) if t is not None)


def test_the_policy_time_leaves_out_the_collects_wait_for_the_device():
    """`host_s` (the ladder's "policy ms/token") is the policy's own host time: a collect's wait for the step
    before's readback (the device's time under overlapped decode) goes to `wait_s` instead."""
    import time

    class SlowEvent:  # a readback event the device finishes 50 ms after the host asks
        def record(self):
            pass

        def synchronize(self):
            time.sleep(0.05)

    cache = read_through_cache(2, 16, 8, 2)
    rt = cache.read_through
    rt.readback_event = SlowEvent()
    for _ in range(3):
        replay_step(cache, [[[0, 1], [2, 3]]])  # each end_step collects the step before: two waits
    assert rt.wait_s >= 0.1
    assert rt.host_s < 0.05  # (the policy's own work at 2 x 16 experts: well under a millisecond a step)
