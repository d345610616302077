"""Live, rollback-safe cache rebuilds: the executor.

A rebuild runs a plan (`planner.py`) on the engine thread between two forward steps: every
shrink first (making room: prefix-cache entries evicted as needed, pages and slots that running
requests hold relocated below the new bound, then the tail freed), then every grow (the tail
allocated). A pool of several tensors changes all of them or none (`ft.memory.resizable`). Each
executed step leaves its inverse on an undo stack; when any step fails (allocation, copy, an
injected fault) the inverses run in reverse order. If an inverse fails too, the others still run
and the failure is reported as `degraded`: the cache manager then reads the geometry back from
the pools (never a stale one) and the engine reports the degraded state. Content that cannot
survive (evicted prefix entries, experts of cut slots) is invalidated consistently: caches go
cold, no request is lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ft.memory.planner import Plan
from ft.errors import InjectedFault, RebuildFailed
from ft.memory.resizable import PoolInconsistent

__all__ = ["InjectedFault", "RebuildFailed", "Rebuilder"]


@dataclass
class _Step:
    name: str  # "shrink kv", "grow moe", ...
    do: Callable[[], None]
    undo: Callable[[], None]
    phase: str  # "free" or "allocate"


class Rebuilder:
    """Executes plans against the pools, the running requests and the prefix cache.

    `holders()` returns (running sequences, prefix cache): what refers to pages and slots.
    Tests set `fault_at` (a step name that raises before it runs) or `fault_in_undo` (a step
    name whose inverse raises); `pools.storage.fault` fails single tensor resizes."""

    def __init__(self, pools, holders: Callable[[], tuple[list, object]], page_size: int) -> None:
        self.pools, self.holders, self.page_size = pools, holders, page_size
        self.fault_at: str | None = None
        self.fault_in_undo: str | None = None
        self.observer: Callable[[str], None] | None = None  # benchmarks: called after each step
        self.measured_peak_bytes = 0

    # ----------------------------------------------------------------------------- steps
    def _steps(self, plan: Plan) -> list[_Step]:
        page = self.page_size
        steps = []
        for s in plan.steps:
            old, new = (s.old // page, s.new // page) if s.pool == "kv" else (s.old, s.new)
            resize = getattr(self, f"_resize_{s.pool}")
            name = f"{s.action} {s.pool}"
            steps.append(_Step(name, do=_bind(resize, new, new < old), undo=self._undo(name, resize, old, old < new),
                               phase="free" if new < old else "allocate"))
        return steps

    def _undo(self, name: str, resize, size: int, shrink: bool) -> Callable[[], None]:
        def undo() -> None:
            if self.fault_in_undo == name:
                raise InjectedFault(f"fault injected in the inverse of '{name}'")
            resize(size, shrink)
        return undo

    def _resize_kv(self, pages: int, shrink: bool) -> None:
        kv = self.pools.kv
        if shrink:
            running, prefix = self.holders()
            # drop prefix entries until what is left fits, then move what is held above the bound
            while kv.num_used_pages > pages and prefix.evict_one():
                pass
            moves = kv.relocate_above(pages)
            if moves:
                for seq in running:
                    seq.pages = [moves.get(p, p) for p in seq.pages]
                prefix.remap_pages(moves)
        kv.resize(pages)

    def _resize_mamba(self, slots: int, shrink: bool) -> None:
        mamba = self.pools.mamba
        if shrink:
            running, prefix = self.holders()
            while mamba.num_used > slots and prefix.evict_one(holding_slot=True):
                pass
            moves = mamba.relocate_above(slots)
            if moves:
                for seq in running:
                    if seq.mamba_slot in moves:
                        seq.mamba_slot = moves[seq.mamba_slot]
                prefix.remap_slots(moves)
        mamba.resize(slots)

    def _resize_moe(self, slots: int, shrink: bool) -> None:
        self.pools.experts.resize(slots)

    # ----------------------------------------------------------------------------- running
    def run(self, plan: Plan) -> dict[str, float]:
        """Execute `plan`; returns phase durations (seconds). Raises RebuildFailed after a
        rollback (with `degraded` set when the rollback could not restore everything)."""
        t0 = time.perf_counter()
        phases = {"quiesce_s": 0.0, "free_s": 0.0, "allocate_s": 0.0, "fill_s": 0.0, "graphs_s": 0.0}
        storage = self.pools.storage
        storage.reset_peak()
        done: list[_Step] = []
        try:
            for step in self._steps(plan):
                ts = time.perf_counter()
                try:
                    if self.fault_at == step.name:
                        raise InjectedFault(f"fault injected at '{step.name}'")
                    step.do()
                except BaseException as e:
                    failures = [str(e)] if isinstance(e, PoolInconsistent) else []
                    failures += self._rollback(done)
                    raise RebuildFailed(step.name, e, "; ".join(failures) or None) from e
                phases[f"{step.phase}_s"] += time.perf_counter() - ts
                done.append(step)
                if self.observer is not None:
                    self.observer(step.name)
        finally:
            self.measured_peak_bytes = storage.peak_bytes
        phases["total_s"] = time.perf_counter() - t0
        return phases

    def _rollback(self, done: list[_Step]) -> list[str]:
        """Run every inverse (the later ones even when an earlier one fails); returns what could
        not be restored."""
        failures = []
        for step in reversed(done):
            try:
                step.undo()
            except BaseException as e:  # noqa: BLE001 - reported as the degraded state
                failures.append(f"undoing '{step.name}': {type(e).__name__}({e})")
        return failures


def _bind(resize: Callable[[int, bool], None], size: int, shrink: bool) -> Callable[[], None]:
    return lambda: resize(size, shrink)
