"""Rebuild plans and reachable ranges, both from one planner.

A plan turns the current geometry into a target as ordered steps: every shrink (which frees
memory) before any grow (which takes it), so the peak is the larger of the two totals, never
their sum. A target is reachable iff its plan's peak fits the budget and every pool is within
its floor and ceiling. `reachable_ranges` asks the same planner, so what the API advertises is
exactly what a resize accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from ft.engine.memory.budget import Geometry, UnitCosts
from ft.units import format_bytes

POOLS = ("moe", "kv", "mamba")


@dataclass(frozen=True)
class Limits:
    """Floors and ceilings per pool in user units (moe slots, kv tokens, mamba slots)."""

    floor: dict[str, int]
    ceiling: dict[str, int]


@dataclass(frozen=True)
class Step:
    action: str  # "shrink" | "grow"
    pool: str
    delta_bytes: int
    total_bytes: int


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


def sizes(g: Geometry) -> dict[str, int]:
    return {"moe": g.moe_slots, "kv": g.kv_tokens, "mamba": g.mamba_slots}


def pool_bytes(pool: str, size: int, c: UnitCosts) -> int:
    if pool == "moe":
        return size * c.expert_slot
    if pool == "kv":
        return -(-size // c.page_size) * c.kv_page
    return size * c.mamba_slot


def make_geometry(moe: int, kv: int, mamba: int, page_size: int) -> Geometry:
    """A geometry with kv rounded up to whole pages."""
    return Geometry(moe, -(-kv // page_size) * page_size, mamba)


def plan(current: Geometry, target: Geometry, costs: UnitCosts, budget: int, limits: Limits) -> Plan:
    cur, tgt = sizes(current), sizes(target)
    total = current.nbytes(costs)
    deltas = {p: pool_bytes(p, tgt[p], costs) - pool_bytes(p, cur[p], costs) for p in POOLS}
    steps, peak = [], total
    for p in sorted(POOLS, key=lambda p: deltas[p]):  # frees first, then the smallest grows
        if tgt[p] == cur[p]:
            continue
        total += deltas[p]
        peak = max(peak, total)
        steps.append(Step("shrink" if deltas[p] < 0 else "grow", p, deltas[p], total))
    reason = None
    for p in POOLS:
        if not limits.floor[p] <= tgt[p] <= limits.ceiling[p]:
            lo, hi = reachable_ranges(current, costs, budget, limits)[p]  # what the user can pick
            reason = f"{p} {tgt[p]} is outside {lo}..{hi}"
            break
    if reason is None and peak > budget:
        changed = [p for p in POOLS if tgt[p] != cur[p]]
        if len(changed) == 1:  # name the range the user can act on
            p = changed[0]
            lo, hi = reachable_ranges(current, costs, budget, limits)[p]
            reason = f"{p} {tgt[p]} is outside {lo}..{hi}"
        else:
            reason = f"peak {format_bytes(peak)} exceeds the rebuild budget {format_bytes(budget)}"
    return Plan(current, target, tuple(steps), peak, budget, reason)


def reachable_ranges(current: Geometry, costs: UnitCosts, budget: int, limits: Limits) -> dict[str, tuple[int, int]]:
    """For each pool, [min, max] of sizes whose plan fits with the other pools held fixed."""
    cur = sizes(current)
    out = {}
    for p in POOLS:
        others = sum(pool_bytes(q, cur[q], costs) for q in POOLS if q != p)
        unit = costs.kv_page if p == "kv" else (costs.expert_slot if p == "moe" else costs.mamba_slot)
        room = (budget - others) // unit if unit else limits.ceiling[p]
        hi = min(limits.ceiling[p], room * (costs.page_size if p == "kv" else 1))
        lo = limits.floor[p]
        out[p] = (lo, hi) if hi >= lo else (lo, lo - 1)  # empty when nothing fits
    return out
