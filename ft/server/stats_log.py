"""The periodic stats line of `ft serve` (`--log-stats-interval`, logger "ft.stats"):

    running 2, waiting 1, prompt 512.0 tok/s, generation 38.5 tok/s, kv 12.5%, expert hits 91.2%, rung 2/5

Rates and the hit rate are over the interval since the previous sample; running, waiting, KV usage
and the rung are the state now. A line is written only for an interval with activity (tokens
computed, or requests running or waiting), so an idle server stays quiet. No torch here: the
samples are plain numbers, from the engine's `EngineStats`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("ft.stats")


@dataclass(frozen=True)
class StatsSample:
    """The engine's figures at one instant (`sample(engine)`): counters are totals since startup."""

    at: float  # seconds, on the logger's clock
    running: int
    waiting: int
    prompt_tokens: int
    generation_tokens: int
    kv_used_tokens: int
    kv_tokens: int
    hits: int | None  # expert cache lookups (None: no offloaded experts)
    misses: int | None
    rung: int | None  # 0-based; None when KV sits between rungs
    rungs: int  # 0: no ladder


def sample(stats: Any, at: float) -> StatsSample:
    """The line's figures from the engine's `EngineStats` (the value /metrics reads too)."""
    return StatsSample(
        at, stats.running, stats.waiting, stats.prompt_tokens, stats.generation_tokens, stats.kv_used_tokens,
        stats.kv_tokens, stats.hits if stats.offloaded else None, stats.misses if stats.offloaded else None,
        stats.rung, stats.rungs,
    )


def active(prev: StatsSample, cur: StatsSample) -> bool:
    """Whether the interval from `prev` to `cur` had activity worth a line."""
    return bool(cur.running or cur.waiting or cur.prompt_tokens != prev.prompt_tokens
                or cur.generation_tokens != prev.generation_tokens)


def format_stats(prev: StatsSample, cur: StatsSample) -> str:
    """The stats line of the interval from `prev` to `cur` (see the module docstring). Rates divide
    by the interval's length; the hit rate is "-" when the interval looked up no expert."""
    dt = max(cur.at - prev.at, 1e-9)
    parts = [
        f"running {cur.running}", f"waiting {cur.waiting}",
        f"prompt {(cur.prompt_tokens - prev.prompt_tokens) / dt:.1f} tok/s",
        f"generation {(cur.generation_tokens - prev.generation_tokens) / dt:.1f} tok/s",
        f"kv {100.0 * cur.kv_used_tokens / cur.kv_tokens if cur.kv_tokens else 0.0:.1f}%",
    ]
    if cur.hits is not None and prev.hits is not None:
        hits, misses = cur.hits - prev.hits, cur.misses - prev.misses
        parts.append(f"expert hits {100.0 * hits / (hits + misses):.1f}%" if hits + misses > 0 else "expert hits -")
    if cur.rungs:
        parts.append(f"rung {cur.rung + 1 if cur.rung is not None else '-'}/{cur.rungs}")  # counted from 1, as ft ctl
    return ", ".join(parts)


class StatsLogger:
    """Call `tick(stats)` as often as convenient: every `interval_s` (on `clock`) it samples
    `stats()` (a callable giving the engine's `EngineStats`, called only when a sample is due), and
    writes the line of the interval just ended if it was active. The first tick only takes the
    baseline. `interval_s` <= 0 turns it off."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[str], None] | None = None) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.emit = emit or log.info
        self.prev: StatsSample | None = None

    def due(self, now: float) -> bool:
        return self.interval_s > 0 and (self.prev is None or now - self.prev.at >= self.interval_s)

    def tick(self, stats: Callable[[], Any]) -> str | None:
        """The line written by this tick, if any."""
        now = self.clock()
        if not self.due(now):
            return None
        cur, prev = sample(stats(), now), self.prev
        self.prev = cur  # an idle interval moves the baseline too: a rate never spans more than one interval
        if prev is None or not active(prev, cur):
            return None
        line = format_stats(prev, cur)
        self.emit(line)
        return line
