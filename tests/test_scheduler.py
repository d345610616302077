"""Scheduling: many requests, preemption under KV pressure, cancellation, prefix-cache eviction."""

from __future__ import annotations


from ft.engine import LLM, SamplingParams
from test_oracle import GREEDY_32, hf_greedy, prompt_of


def make(path, **opts):
    return LLM(model=str(path), device="cpu", dtype="float32", page_size=16, **opts)


def test_more_requests_than_running_slots(tiny_one):
    _, model, path = tiny_one
    prompts = [prompt_of(n, seed=n) for n in (9, 40, 3, 70, 22)]
    out = make(path, max_running_requests=2).generate(prompt_token_ids=prompts, **GREEDY_32)
    assert [o.token_ids for o in out] == [hf_greedy(model, p) for p in prompts]


def test_preemption_under_kv_pressure_recomputes_correctly(tiny_one):
    _, model, path = tiny_one
    # 9 pages of 16 tokens: three requests of ~40 + 32 tokens cannot all hold their KV at once
    llm = make(path, num_tokens=144, max_running_requests=3, enable_prefix_cache=False)
    prompts = [prompt_of(40, seed=s) for s in (21, 22, 23)]
    out = llm.generate(prompt_token_ids=prompts, **GREEDY_32)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in out] == [hf_greedy(model, p) for p in prompts]
    assert llm.engine.pools.kv.num_used_pages == 0 and llm.engine.pools.mamba.num_used == 0


def test_cancel_frees_pages_and_slot_at_once(tiny_one):
    llm = make(tiny_one[2])
    eng = llm.engine
    seq = eng.add_request(prompt_of(50), SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert seq.pages and eng.pools.kv.num_used_pages == len(seq.pages) and eng.pools.mamba.num_used == 1
    assert eng.abort(seq.request_id)
    assert seq.finish_reason == "abort" and not eng.has_work
    assert eng.pools.kv.num_used_pages == 0 and eng.pools.mamba.num_used == 0
    assert not eng.abort(seq.request_id)  # already gone


def test_prefix_cache_entries_are_evicted_for_new_work(tiny_one):
    _, model, path = tiny_one
    llm = make(path, mamba_cache_size=2, max_running_requests=1)
    prompts = [prompt_of(30, seed=s) for s in range(30, 35)]
    for p in prompts:  # each finished request leaves an entry; the pool has 2 slots
        assert llm.generate(prompt_token_ids=[p], **GREEDY_32)[0].token_ids == hf_greedy(model, p)
    eng = llm.engine
    assert len(eng.prefix_cache) == 2 and eng.pools.mamba.num_used == 2


def test_host_prefix_states_are_capped_and_give_back_no_device_slot(tiny_one):
    """With the entries' states in host memory, at most `prefix_host_entries` entries are kept (the
    least recently used dropped first), none holds a device slot, and a hit on a kept one still
    restores the state exactly; shrinking the mamba pool evicts no host entry; the flag's misuse
    is one clear error."""
    import pytest

    from ft.errors import ConfigError

    _, model, path = tiny_one
    llm = make(path, max_running_requests=1, prefix_states_on_host=True)
    eng = llm.engine
    cap = eng.config.prefix_host_entries("cpu")
    assert cap == 4 and eng.pools.mamba.num_slots == 1 and eng.prefix_cache.host_entries == cap
    prompts = [prompt_of(30, seed=s) for s in range(40, 46)]
    outs = [llm.generate(prompt_token_ids=[p], max_new_tokens=3, temperature=0.0, ignore_eos=True)[0]
            for p in prompts]
    assert len(eng.prefix_cache) == cap and eng.prefix_cache.num_slots == 0 and eng.pools.mamba.num_used == 0
    assert eng.prefix_cache.host_bytes == cap * eng.pools.mamba.bytes_per_slot
    from ft.engine.core.admin import cache_state
    from ft.engine.core.stats import engine_stats

    mamba = cache_state(eng, "serving", "m").pools.mamba  # what ft ctl / ft top and /metrics show
    assert (mamba.host_states, mamba.host_bytes, mamba.used) == (cap, eng.prefix_cache.host_bytes, 0)
    stats = engine_stats(eng)
    assert (stats.prefix_entries, stats.prefix_host_bytes) == (cap, eng.prefix_cache.host_bytes)
    late = prompts[-1] + outs[-1].token_ids + [5, 6, 7]
    got = llm.generate(prompt_token_ids=[late], **GREEDY_32)[0]
    assert got.num_cached_tokens > 30 and got.token_ids == hf_greedy(model, late)
    early = prompts[0] + outs[0].token_ids + [5, 6, 7]  # its entry was dropped for the later ones
    assert llm.generate(prompt_token_ids=[early], max_new_tokens=1, temperature=0.0)[0].num_cached_tokens == 0
    held = len(eng.prefix_cache)
    eng.cache.rebuild(mamba=1)
    assert len(eng.prefix_cache) == held

    def no_host_memory(slot):
        raise RuntimeError("pinned host memory exhausted")

    eng.pools.mamba.save = no_host_memory  # the prefix goes uncached; the request and the pools are fine
    again = prompt_of(30, seed=99)
    assert llm.generate(prompt_token_ids=[again], **GREEDY_32)[0].token_ids == hf_greedy(model, again)
    assert eng.prefix_cache.host_failures == 1 and len(eng.prefix_cache) == held
    assert eng.pools.mamba.num_used == 0 and eng.pools.kv.num_used_pages == eng.prefix_cache.cached_only_pages()
    with pytest.raises(ConfigError, match="prefix cache"):
        make(path, prefix_states_on_host=True, enable_prefix_cache=False)


def test_page_aligned_and_unaligned_prefix_hits(tiny_one):
    _, model, path = tiny_one
    for n in (31, 32, 33):  # turn 1 ends before, exactly on and after a page boundary (16)
        llm = make(path)
        t1 = prompt_of(n - 1, seed=n)
        o1 = llm.generate(prompt_token_ids=[t1], max_new_tokens=2, temperature=0.0, ignore_eos=True)[0]
        t2 = t1 + o1.token_ids + [7, 8, 9]
        o2 = llm.generate(prompt_token_ids=[t2], **GREEDY_32)[0]
        assert o2.num_cached_tokens == n and o2.token_ids == hf_greedy(model, t2)


def test_two_branches_share_a_prefix(tiny_one):
    _, model, path = tiny_one
    llm = make(path)
    base = prompt_of(40, seed=50)
    o = llm.generate(prompt_token_ids=[base], max_new_tokens=1, temperature=0.0, ignore_eos=True)[0]
    a, b = base + o.token_ids + [11, 12], base + o.token_ids + [13]
    outs = llm.generate(prompt_token_ids=[a, b], **GREEDY_32)
    assert all(x.num_cached_tokens == 40 for x in outs)
    assert [x.token_ids for x in outs] == [hf_greedy(model, a), hf_greedy(model, b)]


def test_sampling_seed_stop_and_length(tiny_one):
    llm = make(tiny_one[2])
    p = [prompt_of(20)]
    sampled = dict(max_new_tokens=20, temperature=1.0, top_p=0.9, ignore_eos=True)
    a = llm.generate(prompt_token_ids=p, seed=7, **sampled)[0]
    b = llm.generate(prompt_token_ids=p, seed=7, **sampled)[0]
    c = llm.generate(prompt_token_ids=p, seed=8, **sampled)[0]
    assert a.token_ids == b.token_ids != c.token_ids
    greedy = llm.generate(prompt_token_ids=p, **GREEDY_32)[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 32
    stop_id = greedy.token_ids[5]
    stopped = llm.generate(prompt_token_ids=p, stop_token_ids=[stop_id], **GREEDY_32)[0]
    first = greedy.token_ids.index(stop_id)
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[: first + 1]
    text = greedy.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    cut = llm.generate(prompt_token_ids=p, stop=[needle], **GREEDY_32)[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(needle)]


def test_pages_only_the_prefix_cache_holds_are_counted_apart(tiny_one):
    """`PrefixCache.cached_only_pages` (the dashboards' kv "cached"): every used page after the requests
    end; while a next turn runs on the entry, the pages it shares are the request's too, not the cache's
    alone; a second entry sharing the first one's full pages counts them once."""
    llm = make(tiny_one[2])
    eng = llm.engine
    assert eng.prefix_cache.cached_only_pages() == 0
    t1 = prompt_of(40, seed=61)
    o1 = llm.generate(prompt_token_ids=[t1], max_new_tokens=2, temperature=0.0, ignore_eos=True)[0]
    used = eng.pools.kv.num_used_pages
    assert used > 0 and eng.prefix_cache.cached_only_pages() == used
    seq = eng.add_request(t1 + o1.token_ids + [7, 8], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                                     ignore_eos=True))
    eng.step()
    assert seq.num_cached == 41  # (the entry's 40 prompt tokens and the first generated one)
    shared = 41 // 16  # its full pages, now held by the request too
    assert eng.prefix_cache.cached_only_pages() == used - shared
    while not seq.is_finished:
        eng.step()
    assert len(eng.prefix_cache) == 2 and eng.prefix_cache.cached_only_pages() == eng.pools.kv.num_used_pages


def _record_works(eng) -> list:
    """Every ScheduledWork the engine runs from now on, as (rows, tokens, is_prefill)."""
    works, schedule = [], eng.scheduler.schedule

    def recording():
        work = schedule()
        if work is not None:
            works.append(([s.request_id for s in work.seqs], list(work.num_tokens), work.is_prefill))
        return work

    eng.scheduler.schedule = recording
    return works


def _decoding(eng, prompt: list[int], max_new: int, have: int):
    """A greedy request of `prompt` stepped until it has `have` tokens (it is decoding)."""
    seq = eng.add_request(prompt, SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True))
    while len(seq.output_ids) < have:
        eng.step()
    return seq


def _long_prompt_beside_a_decode(path, **opts):
    """A request decoding when a 100-token prompt arrives (chunks of 16): each step's growth of the
    first request's output until the second has its first token, the steps run, and both outputs."""
    eng = make(path, max_prefill_length=16, **opts).engine
    first = _decoding(eng, prompt_of(12, seed=1), 40, 3)
    works = _record_works(eng)
    second = eng.add_request(prompt_of(100, seed=2), SamplingParams(max_new_tokens=40, temperature=0.0,
                                                                    ignore_eos=True))
    growth = []
    while not second.output_ids:
        before = len(first.output_ids)
        eng.step()
        growth.append(len(first.output_ids) - before)
    eng.run_until_done([first, second])
    return growth, works, first, second


def test_a_long_prompt_never_freezes_a_decoding_request(tiny_one):
    """Mixed steps: while the 100-token prompt is prefilled in 7 chunks, every step also decodes the
    running request (one token a step, never a pause), each step's tokens stay within the prefill
    budget, and both requests' tokens are transformers' greedy ones. Unmixed, the running request
    waits for the whole prompt."""
    _, model, path = tiny_one
    growth, works, first, second = _long_prompt_beside_a_decode(path)
    assert growth == [1] * len(growth) and len(growth) >= 7
    assert all(sum(tokens) <= 16 for _, tokens, _ in works)
    assert all(first.request_id in rows for rows, _, _ in works[:len(growth)])
    assert first.output_ids == hf_greedy(model, prompt_of(12, seed=1), 40)
    assert second.output_ids == hf_greedy(model, prompt_of(100, seed=2), 40)
    unmixed, _, first_u, second_u = _long_prompt_beside_a_decode(path, mix_prefill_decode=False)
    assert sum(unmixed) == 0 and len(unmixed) >= 7
    assert (first_u.output_ids, second_u.output_ids) == (first.output_ids, second.output_ids)


def test_a_short_whole_prompt_prefills_alone(tiny_one):
    """A prompt whose whole rest fits `solo_prefill_tokens` (on a GPU: the prefill graphs' largest
    bucket) runs alone, as its graphs need; a longer one carries the decodes."""
    llm = make(tiny_one[2], max_prefill_length=64)
    eng = llm.engine
    eng.scheduler.solo_prefill_tokens = 40
    params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)
    first = _decoding(eng, prompt_of(10, seed=3), 20, 2)
    works = _record_works(eng)
    short = eng.add_request(prompt_of(30, seed=4), params)
    eng.step()
    assert works[-1] == ([short.request_id], [30], True)
    long = eng.add_request(prompt_of(50, seed=5), params)
    eng.step()
    rows, tokens, prefill = works[-1]
    assert prefill and rows[-1] == long.request_id and first.request_id in rows and tokens[-1] == 50


def test_a_step_that_decodes_takes_at_most_the_mixed_prompt_share(tiny_one):
    """--max-mixed-prefill-length 6 with chunks of 16: while the first request decodes (5 more
    tokens), the 100-token prompt advances 6 tokens a step beside its decode row; once nothing
    decodes, whole chunks of 16 again; both requests' tokens are transformers' greedy ones."""
    _, model, path = tiny_one
    eng = make(path, max_prefill_length=16, max_mixed_prefill_length=6).engine
    first = _decoding(eng, prompt_of(12, seed=1), 8, 3)
    works = _record_works(eng)
    second = eng.add_request(prompt_of(100, seed=2), SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                    ignore_eos=True))
    eng.run_until_done([first, second])
    prefills = [(rows, tokens) for rows, tokens, prefill in works if prefill and second.request_id in rows]
    mixed = [tokens[-1] for rows, tokens in prefills if first.request_id in rows]
    alone = [tokens[-1] for rows, tokens in prefills if first.request_id not in rows]
    assert mixed == [6] * 5 and alone == [16, 16, 16, 16, 6]  # 30 prompt tokens beside the decodes, then 70
    assert first.output_ids == hf_greedy(model, prompt_of(12, seed=1), 8)
    assert second.output_ids == hf_greedy(model, prompt_of(100, seed=2), 8)


def test_the_mixed_prompt_share_is_checked():
    import pytest

    from ft.engine.base.engine_config import EngineConfig
    from ft.errors import ConfigError

    with pytest.raises(ConfigError, match="--max-mixed-prefill-length must be >= 1"):
        EngineConfig(max_mixed_prefill_length=0)


def test_a_prompt_mid_prefill_never_joins_a_decode_step(tiny_one):
    """Under KV pressure a chunked prompt's next chunk can find no page while other requests decode: that step
    decodes the others only. (The decode step took every running request: one still prefilling sampled a token
    in the middle of its prompt, and its output was wrong; a CPU stress test of the KV ladder found it.)"""
    _, model, path = tiny_one
    llm = make(path, num_tokens=128, max_running_requests=4, max_prefill_length=32, enable_prefix_cache=False)
    eng = llm.engine
    decode_rows = []
    schedule = eng.scheduler._schedule_decode

    def watched():
        work = schedule()
        if work is not None:
            decode_rows.extend(s.num_uncomputed for s in work.seqs)
        return work

    eng.scheduler._schedule_decode = watched
    prompts = [prompt_of(n, seed=s) for s, n in enumerate((10, 80, 60, 40, 80))]  # each fits the 128 tokens alone
    out = llm.generate(prompt_token_ids=prompts, **GREEDY_32)
    assert [o.token_ids for o in out] == [hf_greedy(model, p) for p in prompts]
    assert eng.scheduler.num_preemptions > 0 and decode_rows and set(decode_rows) == {1}
    assert eng.pools.kv.num_used_pages == 0 and eng.pools.mamba.num_used == 0
