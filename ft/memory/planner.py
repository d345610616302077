"""Rebuild plans and reachable ranges, both from one planner.

A plan turns the current geometry into a target as ordered steps: every shrink (which frees
memory) before any grow (which takes it), so the peak is the larger of the two totals, never
their sum, plus whatever a reallocating backend holds twice while it copies. All bytes come from
`MemoryLayout` (allocator granularity included). A target is reachable iff every pool is within
its floor and ceiling and the plan's peak fits the budget. `reachable_ranges` asks the same
planner (a binary search over each pool's size with the other two held where they are), so
what the API advertises is exactly what a resize accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ft.memory.layout import POOLS, Geometry, MemoryLayout
from ft.units import format_bytes


@dataclass(frozen=True)
class Limits:
    """Floors and ceilings per pool in user units (moe slots, kv tokens, mamba slots)."""

    floor: dict[str, int]
    ceiling: dict[str, int]
    floor_why: dict[str, str] = field(default_factory=dict)  # what each floor is, in words
    ceiling_why: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    action: str  # "shrink" | "grow"
    pool: str
    old: int  # user units
    new: int
    delta_bytes: int
    total_bytes: int  # held by all pools after the step
    peak_bytes: int  # the most held during the step


@dataclass(frozen=True)
class Plan:
    current: Geometry
    target: Geometry
    steps: tuple[Step, ...]
    peak_bytes: int
    budget_bytes: int
    reason: str | None  # why it does not fit; None when it does

    @property
    def fits(self) -> bool:
        return self.reason is None


def _steps(current: Geometry, target: Geometry, layout: MemoryLayout) -> tuple[list[Step], int]:
    cur, tgt = current.sizes(), target.sizes()
    total = layout.nbytes(current)
    peak = total
    deltas = {p: layout.pool_bytes(p, tgt[p]) - layout.pool_bytes(p, cur[p]) for p in POOLS}
    steps = []
    for p in sorted(POOLS, key=lambda p: deltas[p]):  # frees first, then the smallest grows
        if tgt[p] == cur[p]:
            continue
        step_peak, after = layout.resize_peak(p, cur[p], tgt[p], total)
        peak = max(peak, step_peak)
        steps.append(Step("shrink" if tgt[p] < cur[p] else "grow", p, cur[p], tgt[p], after - total, after, step_peak))
        total = after
    return steps, peak


def plan(current: Geometry, target: Geometry, layout: MemoryLayout, budget: int, limits: Limits) -> Plan:
    steps, peak = _steps(current, target, layout)
    cur, tgt = current.sizes(), target.sizes()
    reason = None
    # NOTE: a pool the plan leaves as it is is not checked against its limits: it frees nothing a request
    # holds, and a floor above it (the KV a waiting request will need) is what a later move is for. Checked,
    # a loan's recall (experts alone) was refused while a request waited for the ladder's next rung.
    for p in (q for q in POOLS if tgt[q] != cur[q]):
        if not limits.floor[p] <= tgt[p] <= limits.ceiling[p]:
            lo, hi = reachable_ranges(current, layout, budget, limits)[p]  # what the user can pick
            if tgt[p] < limits.floor[p]:
                why = f"below {limits.floor_why.get(p, 'its floor')} ({limits.floor[p]})"
            else:
                why = f"above {limits.ceiling_why.get(p, 'its ceiling')} ({limits.ceiling[p]})"
            reason = f"{p} {tgt[p]} is outside {lo}..{hi}: {why}"
            break
    if reason is None and steps and peak > budget:
        changed = [p for p in POOLS if tgt[p] != cur[p]]
        if len(changed) == 1:  # name the range the user can act on
            p = changed[0]
            lo, hi = reachable_ranges(current, layout, budget, limits)[p]
            need, has = _two_sizes(peak, budget)
            reason = (f"{p} {tgt[p]} is outside {lo}..{hi}: with the other pools where they are it needs a peak of "
                      f"{need} and the rebuild budget is {has}")
        else:
            reason = joint_reason(current, target, layout, budget, limits, changed, peak)
    return Plan(current, target, tuple(steps), peak, budget, reason)


def joint_reason(current: Geometry, target: Geometry, layout: MemoryLayout, budget: int, limits: Limits,
                 changed: list[str], peak: int) -> str:
    """Why a target that changes several pools does not fit, with numbers, and the nearest targets
    that do: for each pool the target grows, its largest size with the other pools at their target sizes."""
    tgt, cur = target.sizes(), current.sizes()
    sizes = " + ".join(f"{p} {tgt[p]}" for p in changed)
    nearest = []
    for p in (q for q in changed if tgt[q] > cur[q]):
        lo = layout.round_size("kv", limits.floor[p]) if p == "kv" else limits.floor[p]

        def fits(size: int, p: str = p) -> bool:
            return _steps(current, target.with_size(p, size), layout)[1] <= budget

        top = layout.largest(p, fits, lo, tgt[p])
        if top >= lo:
            others = " ".join(f"{q} {tgt[q]}" for q in changed if q != p)
            nearest.append(f"{p} {top} with {others}")
    tail = f"; reachable instead: {', or '.join(nearest)}" if nearest else "; no size of one pool alone makes it fit"
    need, has = _two_sizes(peak, budget)
    return (f"{sizes} together need a peak of {need} and the rebuild budget is {has}{tail} (the ranges "
            f"`ft ctl cache` shows hold the other pools at their current sizes)")


def _two_sizes(a: int, b: int) -> tuple[str, str]:
    """Two byte counts as users read them, exact when the rounded forms would read the same."""
    fa, fb = format_bytes(a), format_bytes(b)
    return (f"{a:,} bytes", f"{b:,} bytes") if fa == fb and a != b else (fa, fb)


def reachable_ranges(current: Geometry, layout: MemoryLayout, budget: int, limits: Limits) -> dict[str, tuple[int, int]]:
    """For each pool, [min, max] of the sizes whose plan fits with the other pools held fixed
    (hi < lo when none does). The plan's peak grows with the pool's size, so the sizes that fit
    are [floor, largest that fits]."""
    return ranges_around(current, current, layout, budget, limits)


def ranges_around(current: Geometry, around: Geometry, layout: MemoryLayout, budget: int,
                  limits: Limits) -> dict[str, tuple[int, int]]:
    """For each pool, [min, max] of its sizes whose plan from `current` fits when the other pools
    go to their sizes in `around` (a target being typed: the ranges follow the other fields)."""
    out = {}
    for p in POOLS:
        lo, hi = limits.floor[p], limits.ceiling[p]
        if p == "kv":
            lo = layout.round_size("kv", lo)

        def fits(size: int, p: str = p) -> bool:
            _, peak = _steps(current, around.with_size(p, size), layout)
            return peak <= budget

        top = layout.largest(p, fits, lo, hi)
        out[p] = (lo, top) if top >= lo else (lo, lo - 1)
    return out
