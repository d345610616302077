"""Routing taken from a synthetic trace instead of the router's top-k: for benchmarks on synthetic
models, whose random router weights route every expert equally often (no trained model does).

A synthetic config may carry ``"routing_trace": {"zipf_s": 1.1, "reuse_p": 0.2, "seed": 0}`` (or
``true`` for `ft.tools.routing_trace.CALIBRATED`). Each request then draws its experts from its
own `RoutingTrace` (per layer a Zipf popularity, reuse of the previous token's experts), its draws
seeded by the engine seed and the request's arrival order. The popularity order (which experts are
popular in each layer) belongs to the model and every request shares it, as a trained router's
popular experts are the model's, seeded by the trace's "seed" (default: the engine seed): with an
order of its own per request (before session 33) each new request met a cache filled by another
order, and `ft serve` at concurrency 1 decoded at half `bench/ladder.py`'s speed. The routing weights
stay the router's softmax at those experts. The draws are made on the host for the tokens of a
step and travel in a persistent buffer (`ForwardBatch.forced_experts`), so a decode step stays a
CUDA graph. A preempted request that is recomputed draws again (benchmarks only).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import torch

from ft.errors import ConfigError
from ft.tools.routing_trace import CALIBRATED, RoutingParams, RoutingTrace, model_popularity


def trace_popularity_seed(spec, default: int) -> int:
    """The config's "routing_trace" seed of the model's popularity order (`model_popularity`);
    `default` (the engine seed) when it names none. Raises ConfigError."""
    if not isinstance(spec, dict) or "seed" not in spec:
        return default
    seed = spec["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"routing_trace's seed must be an integer, got {seed!r}")
    return seed


def trace_params(spec) -> RoutingParams | None:
    """The config's "routing_trace" value -> parameters (None: off). Raises ConfigError."""
    if spec in (None, False):
        return None
    if spec is True:
        return CALIBRATED
    if not isinstance(spec, dict) or set(spec) - {"zipf_s", "reuse_p", "seed"}:
        raise ConfigError(f"routing_trace must be true or {{zipf_s, reuse_p, seed}}, got {spec!r}")
    try:
        return RoutingParams(float(spec.get("zipf_s", CALIBRATED.zipf_s)), float(spec.get("reuse_p", CALIBRATED.reuse_p)))
    except (TypeError, ValueError):
        raise ConfigError(f"routing_trace values must be numbers, got {spec!r}") from None


BULK_MIN_TOKENS = 64
"""A request's rows of a step from this many on (a prefill chunk) are drawn at once on the device
(`TraceRouting._bulk`: per layer, k distinct experts a token from the trace's Zipf law by Gumbel
top-k, which is drawing without replacement; no reuse between the chunk's tokens: a chunk's experts
and their counts follow the same popularity, what a prefill's cost depends on). Drawn in Python at
~0.6 ms a token, the trace took 4.9 s of an 8K prompt's prefill on the flagship, more than the
prefill itself."""


class TraceRouting:
    """Per-request traces; `draw(request_ids, counts)` -> flat expert ids, token-major:
    [sum(counts)][num_layers][top_k] flattened."""

    def __init__(self, params: RoutingParams, num_layers: int, num_experts: int, top_k: int, seed: int,
                 keep: int, device: torch.device | str = "cpu", popularity_seed: int | None = None) -> None:
        """`seed`: the requests' draws (with each request's arrival order); `popularity_seed`: the
        model's popularity order, shared by every request (None: `seed`)."""
        self.params, self.num_layers, self.num_experts, self.top_k = params, num_layers, num_experts, top_k
        self.seed, self.keep, self.device = seed, max(1, keep), torch.device(device)
        self.popularity = model_popularity(num_layers, num_experts, seed if popularity_seed is None else popularity_seed)
        self._log_p: torch.Tensor | None = None  # [layers, experts] log popularity (bulk draws), made once
        self._last: dict[str, torch.Tensor] = {}  # per request: the last bulk row [layers, k], on the device
        self._order = itertools.count()
        self._traces: OrderedDict[str, RoutingTrace] = OrderedDict()
        self._ahead: dict[str, list[int]] = {}  # a token drawn ahead per request (`prefetch`)

    def _trace(self, request_id: str) -> RoutingTrace:
        t = self._traces.get(request_id)
        if t is None:
            t = RoutingTrace(self.num_layers, self.num_experts, self.top_k, self.params,
                             seed=self.seed * 1_000_003 + next(self._order), popularity=self.popularity)
            self._traces[request_id] = t
            while len(self._traces) > self.keep:  # finished requests fall out (least recently drawn)
                gone, _ = self._traces.popitem(last=False)
                self._last.pop(gone, None)
        self._traces.move_to_end(request_id)
        return t

    def draw(self, request_ids: list[str], counts: list[int]) -> list[int] | torch.Tensor:
        """Flat expert ids, token-major, for `counts[i]` tokens of each request: a list, or a 1-D int64
        tensor on the device when a request's rows were drawn at once (`BULK_MIN_TOKENS`)."""
        parts: list[list[int] | torch.Tensor] = []
        cur: list[int] = []
        for rid, n in zip(request_ids, counts):
            ahead = self._ahead.pop(rid, None)
            if ahead is not None and n > 0:  # drawn ahead: the request's next token in its trace
                cur.extend(ahead)
                n -= 1
            trace = self._trace(rid)
            if n >= BULK_MIN_TOKENS:
                if cur:
                    parts.append(cur)
                    cur = []
                parts.append(self._bulk(rid, trace, n))
                continue
            self._settle(rid, trace)
            for _ in range(n):
                for layer in trace.next_token():
                    cur.extend(layer)
        if cur:
            parts.append(cur)
        if all(isinstance(p, list) for p in parts):
            return [v for p in parts for v in p]
        return torch.cat([p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int64, device=self.device)
                          for p in parts])

    def _bulk(self, rid: str, trace: RoutingTrace, n: int) -> torch.Tensor:
        """n tokens of a request at once on the device, flat [n * layers * k]: per layer, the top k of
        the trace's log popularity plus Gumbel noise (k distinct experts, drawn without replacement
        from the Zipf law); seeded from the trace, so deterministic for the engine seed."""
        log_p = self._log_p
        if log_p is None:  # the law is the model's: every request's trace draws from it
            weights, perms = trace.popularity()
            log_w = torch.log(torch.tensor(weights, dtype=torch.float32, device=self.device))
            perm = torch.tensor(perms, dtype=torch.int64, device=self.device)  # [layers, ranks] -> expert
            log_p = torch.empty((self.num_layers, self.num_experts), dtype=torch.float32, device=self.device)
            log_p.scatter_(1, perm, log_w.expand(self.num_layers, -1).contiguous())  # expert perm[l, r] has rank r
            self._log_p = log_p
        gen = torch.Generator(device=self.device)
        gen.manual_seed(trace.rng.getrandbits(63))
        out = torch.empty((n, self.num_layers, self.top_k), dtype=torch.int64, device=self.device)
        for layer in range(self.num_layers):
            u = torch.rand((n, self.num_experts), generator=gen, device=self.device).clamp_(min=1e-20)
            out[:, layer] = (log_p[layer] - torch.log(-torch.log(u))).topk(self.top_k, dim=1).indices
        self._last[rid] = out[-1]
        return out.reshape(-1)

    def _settle(self, rid: str, trace: RoutingTrace) -> None:
        """Before a per-token draw: the trace continues from the request's last bulk row (read from the
        device here, after the step that used it, not while the chunk is queued)."""
        last = self._last.pop(rid, None)
        if last is not None:
            trace.continue_from(last.tolist())

    def step_values(self, request_ids: list[str], counts: list[int], pad: int = 0) -> list[int] | torch.Tensor:
        """`draw` for a step's rows, then `pad` padding rows that repeat the first token's experts
        (flat [sum(counts) + pad][num_layers][top_k])."""
        values = self.draw(request_ids, counts)
        if not pad:
            return values
        row = values[: self.num_layers * self.top_k]
        if isinstance(values, torch.Tensor):
            return torch.cat([values, row.repeat(pad)])
        return values + row * pad

    def prefetch(self, request_ids: list[str]) -> None:
        """Draw each request's next token now (while the device runs a step); the next `draw` for
        the request starts with it: the same tokens in the same order, off the step's critical path
        (a trace draw is ~0.6 ms of Python per token for the flagship)."""
        for rid in request_ids:
            if rid not in self._ahead:
                flat: list[int] = []
                trace = self._trace(rid)
                self._settle(rid, trace)
                for layer in trace.next_token():
                    flat.extend(layer)
                self._ahead[rid] = flat
        while len(self._ahead) > self.keep:  # requests that finished keep nothing
            self._ahead.pop(next(iter(self._ahead)))
