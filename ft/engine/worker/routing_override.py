"""Routing taken from a synthetic trace instead of the router's top-k: for benchmarks on synthetic
models, whose random router weights route every expert equally often (no trained model does).

A synthetic config may carry ``"routing_trace": {"zipf_s": 1.1, "reuse_p": 0.2, "seed": 0}`` (or
``true`` for `ft.tools.routing_trace.CALIBRATED`). Each request then draws its experts from its
own `RoutingTrace` (per layer a Zipf popularity over a fixed permutation, reuse of the previous
token's experts), seeded by the engine seed and the request's arrival order; the routing weights
stay the router's softmax at those experts. The draws are made on the host for the tokens of a
step and travel in a persistent buffer (`ForwardBatch.forced_experts`), so a decode step stays a
CUDA graph. A preempted request that is recomputed draws again (benchmarks only).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from ft.errors import ConfigError
from ft.tools.routing_trace import CALIBRATED, RoutingParams, RoutingTrace


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
"""A request's rows of a step from this many on are drawn at once, without the token-to-token reuse
(`RoutingTrace.bulk`): at ~0.6 ms of Python a token, the per-token draw took 4.9 s of an 8K prompt's
prefill on the flagship, more than the prefill itself."""


class TraceRouting:
    """Per-request traces; `draw(request_ids, counts)` -> flat expert ids, token-major:
    [sum(counts)][num_layers][top_k] flattened."""

    def __init__(self, params: RoutingParams, num_layers: int, num_experts: int, top_k: int, seed: int,
                 keep: int) -> None:
        self.params, self.num_layers, self.num_experts, self.top_k = params, num_layers, num_experts, top_k
        self.seed, self.keep = seed, max(1, keep)
        self._order = itertools.count()
        self._traces: OrderedDict[str, RoutingTrace] = OrderedDict()
        self._ahead: dict[str, list[int]] = {}  # a token drawn ahead per request (`prefetch`)

    def _trace(self, request_id: str) -> RoutingTrace:
        t = self._traces.get(request_id)
        if t is None:
            t = RoutingTrace(self.num_layers, self.num_experts, self.top_k, self.params,
                             seed=self.seed * 1_000_003 + next(self._order))
            self._traces[request_id] = t
            while len(self._traces) > self.keep:  # finished requests fall out (least recently drawn)
                self._traces.popitem(last=False)
        self._traces.move_to_end(request_id)
        return t

    def draw(self, request_ids: list[str], counts: list[int]) -> list[int]:
        out: list[int] = []
        for rid, n in zip(request_ids, counts):
            ahead = self._ahead.pop(rid, None)
            if ahead is not None and n > 0:  # drawn ahead: the request's next token in its trace
                out.extend(ahead)
                n -= 1
            trace = self._trace(rid)
            if n >= BULK_MIN_TOKENS:  # a prefill chunk: drawn at once (`RoutingTrace.bulk`)
                out.extend(trace.bulk(n))
                continue
            for _ in range(n):
                for layer in trace.next_token():
                    out.extend(layer)
        return out

    def step_values(self, request_ids: list[str], counts: list[int], pad: int = 0) -> list[int]:
        """`draw` for a step's rows, then `pad` padding rows that repeat the first token's experts
        (flat [sum(counts) + pad][num_layers][top_k])."""
        values = self.draw(request_ids, counts)
        values += values[: self.num_layers * self.top_k] * pad
        return values

    def prefetch(self, request_ids: list[str]) -> None:
        """Draw each request's next token now (while the device runs a step); the next `draw` for
        the request starts with it: the same tokens in the same order, off the step's critical path
        (a trace draw is ~0.6 ms of Python per token for the flagship)."""
        for rid in request_ids:
            if rid not in self._ahead:
                flat: list[int] = []
                for layer in self._trace(rid).next_token():
                    flat.extend(layer)
                self._ahead[rid] = flat
        while len(self._ahead) > self.keep:  # requests that finished keep nothing
            self._ahead.pop(next(iter(self._ahead)))
