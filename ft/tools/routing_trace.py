"""Synthetic MoE routing that looks like a real model's, for offload benchmarks, and an exact LRU
simulation to calibrate it.

Random router weights route every expert about equally often; trained models do not: a few
experts per layer are popular, and consecutive tokens reuse experts. `RoutingTrace` draws, per
layer, from a Zipf popularity over a random permutation of the experts (exponent `zipf_s`), and
takes each of a token's k experts from the previous token's set with probability `reuse_p`
(the rest from the Zipf law, all k distinct). `lru_hit_rate` replays a trace through one global
LRU cache of (layer, expert) slots, the expert cache's policy, exactly; `belady_hit_rate` gives the
bound no policy passes on a trace (Belady's MIN with bypass: it knows every future access).

`CALIBRATED` holds the parameters fitted (bench/routing_calibration.py) to the published LRU
hit rates for 512 experts / top-10: about 67% at 12.5% of the experts cached, 81% at 25%. The fit
is s = 1.1, p = 0.2 (68.5% and 79.3% over 48 layers); exponents of 0.45-0.85 with p of 0.3-0.45
stay below 68% / 77% in this model, so the fitted law is steeper than that range.
Deterministic for a seed; pure Python and torch-free (runs anywhere, including `ft.tools`'s CLI).
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import OrderedDict
from dataclasses import dataclass

TARGETS = ((0.125, 0.67), (0.25, 0.81))
"""(fraction of all experts cached, LRU hit rate) pairs the calibration aims at."""


@dataclass(frozen=True)
class RoutingParams:
    zipf_s: float  # popularity exponent per layer: p(rank r) ~ 1 / (r + 1) ** s
    reuse_p: float  # probability that an expert slot repeats one of the previous token's experts


CALIBRATED = RoutingParams(zipf_s=1.1, reuse_p=0.2)
"""Fitted by bench/routing_calibration.py (512 experts, top-10; grid on 8 layers, checked on 48);
see bench/RESULTS.md."""


def model_popularity(num_layers: int, num_experts: int, seed: int) -> list[list[int]]:
    """Each layer's popularity order, [layers][rank] -> expert: a random permutation per layer, the
    same for a seed. A trained router's popular experts belong to the model, so every request of one
    model shares them (`RoutingTrace(popularity=...)`)."""
    rng = random.Random(seed)
    return [rng.sample(range(num_experts), num_experts) for _ in range(num_layers)]


class RoutingTrace:
    """Expert choices per token and layer: `next_token()` -> [layers][k] expert ids (distinct per layer).

    `popularity` ([layers][rank] -> expert, `model_popularity`): the order the Zipf law ranks the
    experts in, shared by the traces of one model's requests; None: drawn from `seed` (a trace of
    its own, as one long sequence is)."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, params: RoutingParams = CALIBRATED,
                 seed: int = 0, popularity: list[list[int]] | None = None) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        if not 0.0 <= params.reuse_p <= 1.0 or params.zipf_s < 0:
            raise ValueError(f"zipf_s must be >= 0 and reuse_p in [0, 1], got {params}")
        self.num_layers, self.num_experts, self.top_k, self.params = num_layers, num_experts, top_k, params
        self.rng = random.Random(seed)
        weights = [1.0 / (r + 1) ** params.zipf_s for r in range(num_experts)]
        self._cdf = list(itertools.accumulate(weights))
        if popularity is None:
            self._perm = [self.rng.sample(range(num_experts), num_experts) for _ in range(num_layers)]
        elif len(popularity) != num_layers or any(len(p) != num_experts for p in popularity):
            raise ValueError(f"popularity must be {num_layers} orders of {num_experts} experts")
        else:
            self._perm = popularity  # shared, never written
        self._prev: list[list[int]] = [[] for _ in range(num_layers)]

    def _zipf(self, layer: int) -> int:
        rank = bisect.bisect_left(self._cdf, self.rng.random() * self._cdf[-1])
        return self._perm[layer][min(rank, self.num_experts - 1)]

    def next_token(self) -> list[list[int]]:
        out = []
        for layer in range(self.num_layers):
            prev, chosen = self._prev[layer], []
            seen: set[int] = set()
            while len(chosen) < self.top_k:
                pool = [e for e in prev if e not in seen]
                e = self.rng.choice(pool) if pool and self.rng.random() < self.params.reuse_p else self._zipf(layer)
                if e not in seen:
                    seen.add(e)
                    chosen.append(e)
            self._prev[layer] = chosen
            out.append(chosen)
        return out

    def tokens(self, n: int) -> list[list[list[int]]]:
        return [self.next_token() for _ in range(n)]

    def continue_from(self, last: list[list[int]]) -> None:
        """The next `next_token` reuses from `last` ([layers][k] expert ids): the last token of rows
        drawn elsewhere (a prefill chunk drawn at once, `ft.engine.worker.routing_override`)."""
        if len(last) != self.num_layers:
            raise ValueError(f"last token has {len(last)} layers, the trace {self.num_layers}")
        self._prev = [list(layer) for layer in last]

    def popularity(self) -> tuple[list[float], list[list[int]]]:
        """(the Zipf weight of each rank, each layer's permutation rank -> expert): the law
        `next_token` draws fresh experts from, for a draw made elsewhere."""
        weights = [1.0 / (r + 1) ** self.params.zipf_s for r in range(self.num_experts)]
        return weights, [list(p) for p in self._perm]


def lru_hit_rate(trace: list[list[list[int]]], capacity: int, warmup: int = 0) -> float:
    """Hits / accesses of one global LRU cache of `capacity` (layer, expert) slots over `trace`
    ([token][layer][k]), counting after the first `warmup` tokens. Each (token, layer) is one call
    of the expert cache's policy (`ft.memory.expert_cache.ExpertCache.ensure`): its residents
    become the most recent in order, then each missing expert in order evicts the least recently
    used slot that the call does not use (capacity >= k)."""
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    hits = total = 0
    for t, layers in enumerate(trace):
        for layer, experts in enumerate(layers):
            keys = list(dict.fromkeys((layer, e) for e in experts))
            present = [k for k in keys if k in cache]
            for key in present:
                cache.move_to_end(key)
            for key in keys:
                if key in cache:
                    continue
                if len(cache) >= capacity:
                    victim = next(k for k in cache if k not in keys)
                    del cache[victim]
                cache[key] = None
            if t >= warmup:
                hits += len(present)
                total += len(keys)
    return hits / total if total else 0.0


def belady_hit_rate(trace: list[list[list[int]]], capacity: int, warmup: int = 0) -> float:
    """An upper bound on the hits / accesses of any policy with `capacity` (layer, expert) slots over `trace`
    ([token][layer][k]), counting after the first `warmup` tokens: Belady's MIN with bypass, which knows the
    future. The accesses run one at a time in (token, layer, expert) order; a miss is cached only if its next
    use comes before the farthest next use among the residents (that one is evicted), else it is read and not
    kept, as read-through decode may. Optimal for such accesses (unit-size entries); the expert caches' own
    rules (a step's residents stay through the step, victims chosen before the step) only take from it."""
    import heapq

    if capacity <= 0:
        return 0.0
    keys = [(layer, e) for layers in trace for layer, experts in enumerate(layers) for e in dict.fromkeys(experts)]
    first_counted = sum(len(dict.fromkeys(experts)) for layers in trace[:warmup] for experts in layers)
    never = len(keys)
    nxt = [never] * len(keys)  # the next access of each access's key
    seen: dict[tuple[int, int], int] = {}
    for i in range(len(keys) - 1, -1, -1):
        nxt[i] = seen.get(keys[i], never)
        seen[keys[i]] = i
    resident: dict[tuple[int, int], int] = {}  # key -> its next access
    heap: list[tuple[int, tuple[int, int]]] = []  # (-next access, key); stale once the key moved on or left
    hits = 0
    for i, key in enumerate(keys):
        n = nxt[i]
        if key in resident:
            hits += i >= first_counted
            resident[key] = n
            heapq.heappush(heap, (-n, key))
            continue
        if len(resident) < capacity:
            resident[key] = n
            heapq.heappush(heap, (-n, key))
            continue
        while resident.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)  # stale entries
        far, victim = heap[0]
        if n < -far:  # needed sooner than the farthest resident: it takes that one's slot
            heapq.heappop(heap)
            del resident[victim]
            resident[key] = n
            heapq.heappush(heap, (-n, key))
    counted = len(keys) - first_counted
    return hits / counted if counted else 0.0
