"""Pure logic of `ft top`: budget-bar arithmetic, target range checks, rate ring buffers, and the
pool cells shared with `ft ctl cache`. No Textual, no I/O, no clock reads.

Sizes are in the units users see (moe and mamba in slots, kv in tokens); bytes are plain ints.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ft.ctl.format import POOL_ORDER, format_range
from ft.schemas import CacheState, LadderState, LiveRates, PoolState
from ft.units import format_bytes


@dataclass(frozen=True)
class Segment:
    """A run of `cells` bar cells that belongs to `kind` (a pool name or "free")."""

    kind: str
    cells: int


@dataclass(frozen=True)
class Track:
    """One pool's reachable range on the budget scale, in cells from the left edge:
    [0, lo) is below the pool's minimum, [lo, cur) what it holds above that, [cur, hi) the room it
    could still grow into with the others held fixed. 0 <= lo <= cur <= hi <= width."""

    lo: int
    cur: int
    hi: int
    width: int


def pools_of(state: CacheState) -> dict[str, PoolState]:
    p = state.pools
    return {"moe": p.moe, "kv": p.kv, "mamba": p.mamba}


def unit_bytes(pool: PoolState) -> float:
    """Bytes per unit of a pool (slot or token); 0 when the pool is empty."""
    return pool.bytes / pool.size if pool.size > 0 else 0.0


def scale_bytes(state: CacheState) -> int:
    """The bytes the bar's full width stands for: the budget, or what is allocated if larger."""
    return max(state.budget_bytes, state.allocated_bytes, sum(p.bytes for p in pools_of(state).values()), 1)


def _cells(n_bytes: float, total: int, width: int) -> int:
    return max(0, min(width, round(n_bytes * width / total)))


def budget_segments(state: CacheState, width: int) -> list[Segment]:
    """The budget bar: one segment per pool (moe, kv, mamba) then "free", cells summing to
    `width` exactly (largest remainder), and a pool with any bytes gets at least one cell when
    there is room."""
    if width <= 0:
        return []
    total = scale_bytes(state)
    sizes = [(k, max(0, p.bytes)) for k, p in pools_of(state).items()]
    used = sum(b for _, b in sizes)
    sizes.append(("free", max(0, total - used)))
    exact = [b * width / total for _, b in sizes]
    cells = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda i: exact[i] - cells[i], reverse=True)
    for i in order[: width - sum(cells)]:
        cells[i] += 1
    # a visible pool never rounds away: take the cell from the largest segment
    for i, (_, b) in enumerate(sizes[:-1]):
        if b > 0 and cells[i] == 0 and width >= len(sizes):
            j = max(range(len(cells)), key=lambda k: cells[k])
            if cells[j] > 1:
                cells[j] -= 1
                cells[i] = 1
    return [Segment(k, c) for (k, _), c in zip(sizes, cells)]


def range_track(state: CacheState, name: str, width: int) -> Track:
    """Where pool `name`'s minimum, current and maximum sizes fall on the budget scale."""
    pool = pools_of(state)[name]
    total, u = scale_bytes(state), unit_bytes(pool)
    cur = _cells(pool.bytes, total, width)
    lo = min(cur, _cells(pool.min * u, total, width))
    hi = max(cur, _cells(pool.max * u, total, width))
    return Track(lo, cur, hi, width)


def target_ranges(state: CacheState, targets: dict[str, int | None]) -> dict[str, tuple[int, int]]:
    """Each pool's reachable range [min, max] with the other pools at their targets (None or absent:
    kept). A pool's maximum moves by the bytes the others give up or take (their unit costs): an
    estimate, which the server's dry run replaces (`ResizePlan.ranges`)."""
    pools = pools_of(state)
    changed = {k: t for k, t in targets.items() if t is not None and k in pools and t != pools[k].size}
    out = {}
    for name, pool in pools.items():
        hi = pool.max
        others = {k: v for k, v in changed.items() if k != name}
        u = unit_bytes(pool)
        if others and u > 0:
            freed = sum((pools[k].size - v) * unit_bytes(pools[k]) for k, v in others.items())
            hi = pool.max + int(freed // u)
        out[name] = (pool.min, max(pool.min, hi))
    return out


def check_targets(state: CacheState, targets: dict[str, int | None]) -> list[str]:
    """Problems with resize targets (None keeps a pool), checked locally before asking the server.

    A pool changed alone must stay inside its reachable range [min, max]; when several change, inside
    `target_ranges` (the others as typed: an estimate; the server's dry run has the last word). An
    empty list means worth a dry run."""
    pools = pools_of(state)
    problems = []
    for name, t in targets.items():
        if t is not None and t < 0:
            problems.append(f"{name} must be 0 or more, got {t}")
    if problems:
        return problems
    ranges = target_ranges(state, targets)
    for name, t in targets.items():
        if t is None or name not in pools or t == pools[name].size:
            continue
        lo, hi = ranges[name]
        if t < lo or t > hi:
            problems.append(f"{name} {t} is outside {format_range(lo, hi)}")
    return problems


def parse_target(text: str) -> int | None:
    """An input box's text: '' keeps the pool (None); '65_536' and '65,536' read as 65536.
    Raises ValueError for anything else."""
    text = text.strip().replace(",", "").replace("_", "")
    if not text:
        return None
    n = int(text)
    return n


def pool_cells(state: CacheState) -> dict[str, list[str]]:
    """Per pool: [size in its unit, bytes, reachable range], exactly as `ft ctl cache` prints
    them (`ft.ctl.format.format_cache`)."""
    moe, kv, mamba = state.pools.moe, state.pools.kv, state.pools.mamba
    if moe.total_experts:
        moe_size = f"{moe.size} slots ({moe.policy}, {100.0 * moe.size / moe.total_experts:.1f}%)"
    else:
        moe_size = f"{moe.size} slots ({moe.policy})"
    sizes = {"moe": moe_size, "kv": f"{kv.size} tok ({kv.pages} x {kv.page_size})", "mamba": f"{mamba.size} slots"}
    return {k: [sizes[k], format_bytes(p.bytes), format_range(p.min, p.max)] for k, p in pools_of(state).items()}


def pool_usage(state: CacheState) -> dict[str, str]:
    """What each pool holds now: moe hit rate (since startup) and resident fraction, kv pages held by
    requests and by cached prefixes apart, mamba slots used (and the cached prefixes' states kept in host
    memory, --prefix-states-on-host); the expert slots' loan from the prefill reserve while it is out."""
    moe, kv, mamba = state.pools.moe, state.pools.kv, state.pools.mamba
    res = f"{100.0 * moe.resident / moe.size:.0f}%" if moe.size else "-"
    live = kv.used - kv.cached
    cached = f" +{kv.cached} cached" if kv.cached else ""
    return {
        "moe": f"hit {100.0 * moe.hit_rate:.1f}% res {res}"  # (since startup: the live plot's is "recent")
               + (f" +{format_bytes(moe.lent_bytes)} lent" if moe.lent_bytes else ""),  # --lend-prefill-reserve
        "kv": f"used {live}/{kv.pages} ({100.0 * live / kv.pages:.0f}%){cached}" if kv.pages else "used 0",
        "mamba": f"used {mamba.used}/{mamba.size}" + (f" (<= {mamba.on_demand_max})" if mamba.on_demand_max else "")
                 + (f" +{mamba.host_states} on host ({format_bytes(mamba.host_bytes)})" if mamba.host_states else ""),
    }


def format_uptime(seconds: float) -> str:
    """12 s, 5m03s, 2h07m, 3d04h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def format_age(seconds: float) -> str:
    """How long ago: 0.4 s, 12 s, 5m03s, 2h07m."""
    s = max(0.0, seconds)
    return f"{s:.1f} s" if s < 10 else format_uptime(s)


STALE_POLLS = 3  # an update older than this many refresh intervals is marked stale


def is_stale(age: float, refresh: float) -> bool:
    """Whether figures last updated `age` s ago are stale: more than STALE_POLLS refresh intervals
    (at least 1 s, so that a fast refresh does not flicker)."""
    return age > max(1.0, STALE_POLLS * refresh)


def is_newer(new, shown) -> bool:
    """Whether the answer `new` may replace `shown` (a `CacheState` or a `RequestList`): one server
    process's answers are ordered by their uptime (a monotonic clock), so one older than what is
    shown (an out-of-order answer) is dropped. An answer from another process (a restart: another
    `started_at`), or without the stamp (a server not serving yet, or an older one), starts over."""
    if shown is None or not new.started_at or new.started_at != shown.started_at:
        return True
    return new.uptime_s >= shown.uptime_s


def rung_label(ladder: LadderState, kv_tokens: int) -> str:
    """Where `kv_tokens` sits on the ladder, rungs counted from 1 as `ft ctl` and the serve banner
    count them: 'rung 2/7', 'between rungs 2 and 3 of 7', 'below rung 1 of 7', 'above rung 7 of 7';
    '' without rungs."""
    rungs = ladder.rungs
    n = len(rungs)
    if not n:
        return ""
    if kv_tokens in rungs:
        return f"rung {rungs.index(kv_tokens) + 1}/{n}"
    below = sum(1 for r in rungs if r < kv_tokens)
    if below == 0:
        return f"below rung 1 of {n}"
    if below == n:
        return f"above rung {n} of {n}"
    return f"between rungs {below} and {below + 1} of {n}"


@dataclass
class RateHistory:
    """Ring buffers of the live rates, one sample per event: the last `capacity` samples of
    decode tokens/s, expert hit rate (0..1), KV usage (0..1) and the engine's busy share (0..1), the slow steps
    of each interval (`slow_steps`: their sum over the window), and when each came (the caller's clock, seconds)
    for the plots' time span."""

    capacity: int = 240
    decode: deque = field(init=False)
    hit_rate: deque = field(init=False)
    kv_usage: deque = field(init=False)
    busy: deque = field(init=False)
    slow: deque = field(init=False)
    times: deque = field(init=False)

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be 1 or more, got {self.capacity}")
        self.decode = deque(maxlen=self.capacity)
        self.hit_rate = deque(maxlen=self.capacity)
        self.kv_usage = deque(maxlen=self.capacity)
        self.busy = deque(maxlen=self.capacity)
        self.slow = deque(maxlen=self.capacity)
        self.times = deque(maxlen=self.capacity)

    def push(self, rates: LiveRates, t: float = 0.0) -> None:
        self.decode.append(max(0.0, rates.decode_tokens_per_s))
        self.hit_rate.append(min(1.0, max(0.0, rates.expert_hit_rate)))
        self.kv_usage.append(min(1.0, max(0.0, rates.kv_usage)))
        self.busy.append(min(1.0, max(0.0, rates.engine_busy)))
        self.slow.append(max(0, rates.slow_steps))
        self.times.append(t)

    def __len__(self) -> int:
        return len(self.decode)

    def span(self) -> float:
        """Seconds between the oldest and the newest sample."""
        return self.times[-1] - self.times[0] if len(self.times) > 1 else 0.0

    def slow_steps(self) -> int:
        """The server's slow steps within the window (`ft.engine.core.slow_steps`)."""
        return sum(self.slow)

    def series(self) -> dict[str, list[float]]:
        return {"decode": list(self.decode), "hit_rate": list(self.hit_rate), "kv_usage": list(self.kv_usage),
                "busy": list(self.busy)}


def nice_ceiling(x: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten that is >= x (1 for x <= 0): a plot's top."""
    if x <= 0:
        return 1.0
    exp = math.floor(math.log10(x))
    for m in (1.0, 2.0, 2.5, 5.0, 10.0):
        top = m * 10.0**exp
        if top >= x * (1 - 1e-9):
            return top
    return 10.0 ** (exp + 1)


BLOCKS = " ▁▂▃▄▅▆▇█"


def bucket_max(values: list[float], width: int) -> list[float]:
    """`values` squeezed into at most `width` columns, each the largest of its run (a peak is never
    averaged away); fewer values than columns stay as they are."""
    n = len(values)
    if n <= width or width <= 0:
        return list(values) if width > 0 else []
    return [max(values[i * n // width:(i + 1) * n // width]) for i in range(width)]


def plot_rows(values: list[float], lo: float, hi: float, width: int, height: int) -> list[str]:
    """A bar plot `height` rows of `width` cells (top row first), eighth blocks on the scale
    lo..hi, the newest value in the rightmost column and blanks left of the oldest. A value at or
    below `lo` keeps a one-eighth baseline so that an idle series still shows."""
    if width <= 0 or height <= 0:
        return [""] * max(0, height)
    cols = bucket_max(values, width)
    pad = width - len(cols)
    rows = [[" "] * width for _ in range(height)]
    span = hi - lo if hi > lo else 1.0
    for i, v in enumerate(cols):
        f = min(1.0, max(0.0, (v - lo) / span))
        eighths = max(1, round(f * height * 8))
        for r in range(height):  # r = 0 is the bottom row
            cell = min(8, max(0, eighths - 8 * r))
            rows[height - 1 - r][pad + i] = BLOCKS[cell]
    return ["".join(r) for r in rows]


def format_scale(v: float, unit: str) -> str:
    """An axis label: '100%' for a fraction (unit '%'), '95 tok/s' / '2.5 tok/s' otherwise."""
    if unit == "%":
        return f"{100.0 * v:.0f}%"
    return f"{v:g} {unit}" if unit else f"{v:g}"


def backoff_delays(first: float = 0.5, factor: float = 2.0, cap: float = 10.0):
    """Reconnect delays: 0.5, 1, 2, 4, 8, 10, 10, ... seconds."""
    d = first
    while True:
        yield min(d, cap)
        d = min(d * factor, cap)


__all__ = ["POOL_ORDER", "Segment", "Track", "budget_segments", "range_track", "check_targets", "parse_target",
           "pool_cells", "pool_usage", "format_uptime", "format_age", "is_stale", "is_newer", "rung_label",
           "RateHistory", "nice_ceiling", "bucket_max", "plot_rows", "format_scale", "backoff_delays",
           "unit_bytes", "pools_of"]
