"""Replays a routing trace through the expert cache's read-through mode on the CPU: the real
`ExpertCache` and `ReadThrough` policy, the lookup kernel's torch reference, no weights (the
landing writes the MoE kernels would do are left out: they change bytes, not the bookkeeping).

`read_through_hit_rate` is what an offloaded decode at batch 1 (or more) would hit with a given number of
slots, to set beside the exact LRU (`routing_trace.lru_hit_rate`), whose misses are cached before
the step that needs them: read-through caches a miss after its step, reserves landing slots, and
never evicts what the previous step used, so it hits a little less.
"""

from __future__ import annotations

import torch

from ft.kernels.expert_lookup import expert_lookup_ref
from ft.kernels.moe import SlotWeights
from ft.memory.expert_cache import ExpertCache


def read_through_cache(num_layers: int, num_experts: int, num_slots: int, top_k: int, policy: str = "lru",
                       rows: int = 1, mapped_victims: bool = False) -> ExpertCache:
    """An expert cache of one byte per expert (the weights are not looked at) in read-through mode."""
    host = SlotWeights(torch.zeros(num_layers, num_experts, 1), torch.zeros(num_layers, num_experts, 1))
    cache = ExpertCache(host, num_slots, torch.device("cpu"))
    cache.enable_read_through(top_k * rows, policy, mapped_victims=mapped_victims)
    return cache


def replay_step(cache: ExpertCache, routed: list[list[list[int]]]) -> None:
    """One decode step of len(routed) rows: routed[row][layer] = that row's k experts."""
    rt = cache.read_through
    k = len(routed[0][0])
    rt.begin_step(len(routed), k)
    for layer in range(cache.num_layers):
        ids = torch.tensor([row[layer] for row in routed], dtype=torch.int64)
        expert_lookup_ref(ids, cache.slot_table, rt.book, layer)
    rt.end_step()


def read_through_hit_rate(trace: list[list[list[int]]], num_slots: int, warmup: int = 0, policy: str = "lru",
                          prefill: int = 0, mapped_victims: bool = False,
                          others: list[list[list[list[int]]]] = ()) -> float:
    """Hits / pairs of decode over `trace` ([token][layer][k]) counting after `warmup` tokens: batch 1,
    or with `others` (traces as long) one row more for each, step t routing every trace's token t.
    The first `prefill` tokens of `trace` go through `ensure` (a prompt's prefill loads its experts)."""
    traces = [trace, *others]
    layers, k = len(trace[0]), len(trace[0][0])
    experts = 1 + max(e for tr in traces for tok in tr for layer in tok for e in layer)
    cache = read_through_cache(layers, experts, num_slots, k, policy, rows=len(traces), mapped_victims=mapped_victims)
    for tok in trace[:prefill]:
        for layer, ids in enumerate(tok):
            cache.ensure(layer, ids, count=False)
    hits = misses = 0
    for t in range(prefill, len(trace)):
        if t == warmup:
            cache.collect()
            hits, misses = cache.stats.hits, cache.stats.misses
        replay_step(cache, [tr[t] for tr in traces])
    cache.collect()
    total = cache.stats.hits + cache.stats.misses - hits - misses
    return (cache.stats.hits - hits) / total if total else 0.0
