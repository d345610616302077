"""The synthetic routing trace (Zipf popularity + reuse) and the exact LRU simulation that calibrates it."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ft.tools.routing_trace import CALIBRATED, TARGETS, RoutingParams, RoutingTrace, lru_hit_rate


def test_trace_is_deterministic_distinct_and_skewed():
    a = RoutingTrace(3, 64, 4, seed=5).tokens(200)
    assert a == RoutingTrace(3, 64, 4, seed=5).tokens(200) and a != RoutingTrace(3, 64, 4, seed=6).tokens(200)
    assert all(len(set(layer)) == 4 and all(0 <= e < 64 for e in layer) for tok in a for layer in tok)
    counts = Counter(e for tok in a for e in tok[0])
    assert counts.most_common(1)[0][1] > 3 * (200 * 4 / 64)  # a popular expert, far above uniform


def test_reuse_probability_shows_in_the_trace():
    """With reuse p the share of a token's experts repeated from the previous token is p + (the rest
    by chance); with p = 0 and no skew it is the chance overlap of uniform draws alone."""
    def repeated(params):
        t = RoutingTrace(1, 256, 8, params, seed=1).tokens(2000)
        return sum(len(set(a[0]) & set(b[0])) for a, b in zip(t, t[1:])) / (8 * 1999)

    uniform = repeated(RoutingParams(0.0, 0.0))
    assert uniform < 0.06  # 8 of 256: ~3% by chance
    assert 0.45 < repeated(RoutingParams(0.0, 0.5)) < 0.6


def _lru_by_list(trace, capacity):
    """A second, naive LRU (a list, most recent last) to check `lru_hit_rate` against: per (token,
    layer) call the residents move to the end in order, then each missing expert evicts the oldest
    entry the call does not use."""
    cache, hits, total = [], 0, 0
    for tok in trace:
        for layer, experts in enumerate(tok):
            keys = [(layer, e) for e in experts]
            for key in keys:
                if key in cache:
                    hits += 1
                    cache.remove(key)
                    cache.append(key)
            for key in keys:
                if key not in cache:
                    if len(cache) == capacity:
                        cache.remove(next(c for c in cache if c not in keys))
                    cache.append(key)
            total += len(keys)
    return hits / total


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), capacity=st.integers(2, 40), s=st.floats(0, 1.5), p=st.floats(0, 1))
def test_lru_simulation_is_exact(seed, capacity, s, p):
    trace = RoutingTrace(2, 24, 2, RoutingParams(s, p), seed).tokens(60)
    assert lru_hit_rate(trace, capacity) == _lru_by_list(trace, capacity)


def test_calibrated_trace_gives_the_published_hit_rates():
    """512 experts / top-10 (8 layers here, as the calibration's grid): within 3 points of ~67% at
    12.5% cached and within 3.5 of ~81% at 25% (bench/routing_calibration.py)."""
    trace = RoutingTrace(8, 512, 10, CALIBRATED, seed=3).tokens(600)
    got = [lru_hit_rate(trace, int(frac * 8 * 512), warmup=200) for frac, _ in TARGETS]
    assert abs(got[0] - TARGETS[0][1]) < 0.03 and abs(got[1] - TARGETS[1][1]) < 0.035, got


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), capacity=st.integers(3, 30), s=st.floats(0, 1.5), p=st.floats(0, 1))
def test_expert_cache_policy_is_the_simulated_lru(seed, capacity, s, p):
    """The engine's expert cache, fed a recorded trace one (token, layer) call at a time, hits exactly
    as the simulation says, and never evicts an expert the current call uses."""
    import torch

    from ft.kernels.moe import SlotWeights
    from ft.memory.expert_cache import ExpertCache

    layers, experts, k = 2, 16, 3
    trace = RoutingTrace(layers, experts, k, RoutingParams(s, p), seed).tokens(40)
    host = SlotWeights(torch.zeros(layers, experts, 2, 4), torch.zeros(layers, experts, 4, 1))
    cache = ExpertCache(host, capacity, torch.device("cpu"))
    for tok in trace:
        for layer, chosen in enumerate(tok):
            cache.ensure(layer, chosen)
            assert all(cache.is_resident(layer, e) for e in chosen)
    total = cache.stats.hits + cache.stats.misses
    assert total == 40 * layers * k and cache.stats.hits / total == lru_hit_rate(trace, capacity)



def test_continue_from_sets_the_token_the_next_one_reuses():
    t = RoutingTrace(2, 32, 3, RoutingParams(0.0, 1.0), seed=1)  # reuse always: the next token repeats the last
    t.continue_from([[4, 5, 6], [7, 8, 9]])
    assert [sorted(layer) for layer in t.next_token()] == [[4, 5, 6], [7, 8, 9]]
    weights, perms = t.popularity()
    assert len(weights) == 32 and sorted(perms[0]) == list(range(32))


def _best_by_search(trace, capacity):
    """The best hit count over every choice of what to keep after each access, the accesses one at a time in
    (token, layer, expert) order (exhaustive; tiny traces only): after a miss the key may be kept, evicting any
    resident when full, or not; a resident may leave at any time."""
    import itertools

    keys = [(layer, e) for layers in trace for layer, experts in enumerate(layers) for e in dict.fromkeys(experts)]
    states = {frozenset(): 0}
    for key in keys:
        after = {}
        for res, hits in states.items():
            h = hits + (key in res)
            grown = res | {key}
            for keep in range(len(grown) + 1):  # any subset of what is there after the access, within capacity
                if keep > capacity:
                    break
                for kept in itertools.combinations(sorted(grown), keep):
                    new = frozenset(kept)
                    after[new] = max(after.get(new, -1), h)
        states = after
    return max(states.values()) / len(keys)


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_the_best_any_policy_does_on_tiny_traces(seed):
    from ft.tools.routing_trace import belady_hit_rate

    trace = RoutingTrace(2, 5, 2, seed=seed).tokens(6)
    for capacity in (1, 2, 3):
        assert belady_hit_rate(trace, capacity) == pytest.approx(_best_by_search(trace, capacity)), (seed, capacity)
    for capacity in (2, 3):  # (the LRU holds a call's k = 2 experts at least)
        assert belady_hit_rate(trace, capacity) >= lru_hit_rate(trace, capacity)
