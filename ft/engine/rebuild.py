"""Live, rollback-safe cache rebuilds.

A rebuild runs a plan (`memory/planner.py`) on the engine thread between two forward steps:
every shrink first (making room: prefix-cache entries evicted as needed, pages and slots that
running requests hold relocated below the new bound, then the tail freed), then every grow
(the tail allocated). Each executed step leaves its inverse on an undo stack; when any step
fails (allocation, copy, an injected fault) the inverses run in reverse order and the engine
keeps its old geometry. Content that cannot survive (evicted prefix entries, experts of cut
slots) is invalidated consistently: caches go cold, no request is lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ft.engine.memory.budget import Geometry
from ft.engine.memory.planner import Plan, sizes


class RebuildFailed(RuntimeError):
    """A rebuild failed and was rolled back; `step` names the step, the cause is chained."""

    def __init__(self, step: str, cause: BaseException) -> None:
        super().__init__(f"step '{step}' failed: {type(cause).__name__}({cause})")
        self.step = step


class InjectedFault(RuntimeError):
    """Raised on purpose by tests at a named step."""


@dataclass
class _Step:
    name: str  # "shrink kv", "grow moe", ...
    do: Callable[[], None]
    undo: Callable[[], None]
    phase: str  # "free" or "allocate"


class Rebuilder:
    """Executes plans against an engine's pools, scheduler and prefix cache."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.fault_at: str | None = None  # tests: the step name that raises InjectedFault
        self.observer: Callable[[str], None] | None = None  # benchmarks: called after each step

    # ----------------------------------------------------------------------------- steps
    def _steps(self, plan: Plan) -> list[_Step]:
        cur, tgt = sizes(plan.current), sizes(plan.target)
        page = self.engine.config.page_size
        units = {"moe": (cur["moe"], tgt["moe"]), "kv": (cur["kv"] // page, tgt["kv"] // page),
                 "mamba": (cur["mamba"], tgt["mamba"])}
        steps = []
        for s in plan.steps:
            old, new = units[s.pool]
            resize = getattr(self, f"_resize_{s.pool}")
            steps.append(_Step(
                f"{s.action} {s.pool}",
                do=_bind(resize, new, new < old),
                undo=_bind(resize, old, old < new),
                phase="free" if new < old else "allocate",
            ))
        return steps

    def _resize_kv(self, pages: int, shrink: bool) -> None:
        e = self.engine
        if shrink:
            # drop prefix entries until what is left fits, then move what is held above the bound
            while e.pools.kv.num_used_pages > pages and e.prefix_cache.evict_one():
                pass
            moves = e.pools.kv.relocate_above(pages)
            if moves:
                for seq in e.scheduler.running:
                    seq.pages = [moves.get(p, p) for p in seq.pages]
                e.prefix_cache.remap_pages(moves)
        e.pools.kv.resize(pages)

    def _resize_mamba(self, slots: int, shrink: bool) -> None:
        e = self.engine
        if shrink:
            while e.pools.mamba.num_used > slots and e.prefix_cache.evict_one():
                pass
            moves = e.pools.mamba.relocate_above(slots)
            if moves:
                for seq in e.scheduler.running:
                    if seq.mamba_slot in moves:
                        seq.mamba_slot = moves[seq.mamba_slot]
                e.prefix_cache.remap_slots(moves)
        e.pools.mamba.resize(slots)

    def _resize_moe(self, slots: int, shrink: bool) -> None:
        self.engine.pools.experts.resize(slots)

    # ----------------------------------------------------------------------------- running
    def run(self, plan: Plan) -> dict[str, float]:
        """Execute `plan`; returns phase durations (seconds). Raises RebuildFailed after a rollback."""
        t0 = time.perf_counter()
        phases = {"quiesce_s": 0.0, "free_s": 0.0, "allocate_s": 0.0, "fill_s": 0.0, "graphs_s": 0.0}
        self.measured_peak_bytes = self.pool_bytes()
        done: list[_Step] = []
        for step in self._steps(plan):
            ts = time.perf_counter()
            try:
                if self.fault_at == step.name:
                    raise InjectedFault(f"fault injected at '{step.name}'")
                step.do()
            except BaseException as e:
                self._rollback(done)
                raise RebuildFailed(step.name, e) from e
            phases[f"{step.phase}_s"] += time.perf_counter() - ts
            done.append(step)
            self.measured_peak_bytes = max(self.measured_peak_bytes, self.pool_bytes())
            if self.observer is not None:
                self.observer(step.name)
        phases["total_s"] = time.perf_counter() - t0
        return phases

    def pool_bytes(self) -> int:
        """Bytes the three pools hold now: physical chunks mapped (CUDA VMM), else the tensors'
        storages."""
        storage = getattr(self.engine, "storage", None)
        if storage is not None and storage.use_vmm:
            return storage.mapped_bytes()
        p = self.engine.pools
        tensors = [p.kv.kv, p.mamba.conv, p.mamba.ssm] + ([t for t in p.experts.slots if t is not None] if p.experts else [])
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def _rollback(self, done: list[_Step]) -> None:
        for step in reversed(done):
            step.undo()


def _bind(resize: Callable[[int, bool], None], size: int, shrink: bool) -> Callable[[], None]:
    return lambda: resize(size, shrink)


def geometry_of(engine) -> Geometry:
    """The geometry the pools really have (what a rebuild must land on)."""
    p = engine.pools
    return Geometry(p.experts.num_slots if p.experts else 0, p.kv.num_tokens, p.mamba.num_slots)
