"""The cache manager: budget, byte layout, pools, limits and ranges, plans, rebuilds, history.

It owns the three pools and is the only place that turns sizes into bytes (`layout.py`). The
geometry is never stored: it is read back from the pools, so it cannot go stale, not even after
a rollback that failed half way (the manager then reports `degraded`). The engine gives it the
pools' shapes and the measured budget; the scheduler and prefix cache are attached once they
exist (they hold pages and slots that limits and relocations must respect).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch

from ft.memory.budget import MemoryBudget, startup_geometry
from ft.memory.layout import Geometry, MemoryLayout
from ft.engine.cache.log_line import history_line
from ft.memory.planner import Limits, Plan, plan, ranges_around, reachable_ranges
from ft.engine.cache.rebuild import Rebuilder
from ft.errors import RebuildFailed, RebuildRefused
from ft.kernels.moe import SlotWeights
from ft.memory.cache_pools import CachePools
from ft.memory.expert_cache import ExpertCache
from ft.memory.kv_pool import KVPool
from ft.memory.mamba_pool import MambaPool, SlotState
from ft.memory.storage import PoolStorage

log = logging.getLogger("ft.cache")


@dataclass(frozen=True)
class PoolShapes:
    """What the pools are made of (from the model config): KV pages of every full-attention
    layer, conv + SSM state of every linear-attention layer, routed experts from a host store."""

    page_size: int
    kv_layers: int
    kv_heads: int
    head_dim: int
    mamba_layers: int
    conv_dim: int
    conv_width: int
    v_heads: int
    k_dim: int
    v_dim: int
    dtype: torch.dtype
    device: torch.device
    host_experts: SlotWeights | None
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype (None: the compute dtype)
    slot_states: tuple[SlotState, ...] = ()  # the model's other per-sequence states (in the mamba pool)
    index_key_dim: int = 0  # QSA's raw indexer key per token and attention layer (in the KV pool), 0: none

    def kv_pool(self, pages: int, storage: PoolStorage) -> KVPool:
        return KVPool(pages, self.page_size, self.kv_layers, self.kv_heads, self.head_dim, self.kv_dtype or self.dtype,
                      self.device, storage, self.index_key_dim, self.dtype)

    def mamba_pool(self, slots: int, storage: PoolStorage) -> MambaPool:
        return MambaPool(slots, self.mamba_layers, self.conv_dim, self.conv_width, self.v_heads, self.k_dim,
                         self.v_dim, self.dtype, self.device, storage, self.slot_states)

    def expert_cache(self, slots: int, storage: PoolStorage) -> ExpertCache | None:
        if self.host_experts is None:
            return None
        return ExpertCache(self.host_experts, slots, self.device, storage=storage)

    @property
    def total_experts(self) -> int:
        h = self.host_experts
        return 0 if h is None else h.w13.shape[0] * h.w13.shape[1]


@dataclass(frozen=True)
class SizingOptions:
    """How the startup geometry is chosen and what bounds a resize."""

    context_limit: int
    mamba_slots: int
    num_tokens: int | None
    moe_backend: str  # "offload" | "resident"
    moe_cache_size: int | None
    storage_backend: str | None = None  # None: the best the device has (vmm, mmap, else realloc)
    kv_fill_limit: int = 0  # `startup_geometry`: with every expert resident, KV fills the budget up to this many tokens
    loan_bytes: int = 0  # the idle part of the prefill reserve the expert slots may borrow (`CacheManager.lend`)


def measure_layout(shapes: PoolShapes, storage: PoolStorage) -> MemoryLayout:
    """Bytes per unit of every pool tensor, read from real one-unit pools (never guessed)."""
    probe = PoolStorage(shapes.device, backend="realloc")
    rows = {"kv": shapes.kv_pool(1, probe).tensors, "mamba": shapes.mamba_pool(1, probe).tensors}
    experts = shapes.expert_cache(1, probe)
    rows["moe"] = experts.tensors if experts else []
    row_bytes = {p: tuple(t[0].numel() * t.element_size() for t in ts) for p, ts in rows.items()}
    return MemoryLayout(row_bytes, shapes.page_size, storage.granularity, storage.reallocates, storage.backend)


class CacheManager:
    def __init__(self, shapes: PoolShapes, budget: MemoryBudget, opts: SizingOptions, expert_floor: int) -> None:
        t0 = time.time()
        self.shapes, self.budget, self.opts, self.expert_floor = shapes, budget, opts, expert_floor
        self.loan_bytes = opts.loan_bytes  # what `lend` gives the expert slots beside the budget (0: never)
        self.lent = 0  # bytes the expert slots hold beyond the budget now (`lend`, `recall`)
        self.storage = PoolStorage(shapes.device, budget.budget_bytes + self.loan_bytes, opts.storage_backend)
        self.layout = measure_layout(shapes, self.storage)
        geo = startup_geometry(
            budget, self.layout, total_experts=self.total_experts, expert_floor=expert_floor,
            context_limit=opts.context_limit, mamba_slots=opts.mamba_slots, num_tokens=opts.num_tokens,
            moe_backend=opts.moe_backend, moe_cache_size=opts.moe_cache_size, kv_fill_limit=opts.kv_fill_limit,
        )
        self.pools = self._build(geo)
        self.degraded: str | None = None  # what a failed rollback left behind, until a rebuild succeeds
        self.peers = None  # tensor parallelism, rank 0: the worker ranks' `TPPeers` (every rebuild is joint)
        self._scheduler = None  # attached: the holders of pages and slots
        self._prefix = None
        me = weakref.ref(self)  # NOTE: no reference cycle: the pools go as soon as the engine does (not at a gc pass)
        self.rebuilder = Rebuilder(self.pools, lambda: (me()._scheduler.running, me()._prefix), shapes.page_size)
        self.history: list[dict] = [{
            "id": 0, "time": time.time(), "trigger": "startup", "reason": None, "from": {},
            "to": geo.sizes(), "peak_bytes": self.layout.nbytes(geo), "status": "ok", "error": None,
            "phases": {"total_s": round(time.time() - t0, 3)},
        }]

    def _build(self, geo: Geometry) -> CachePools:
        s, st = self.shapes, self.storage
        experts = s.expert_cache(geo.moe_slots, st)
        if experts is not None and self.opts.moe_backend == "resident":
            experts.preload_all()
        return CachePools(s.kv_pool(self.layout.units("kv", geo.kv_tokens), st), s.mamba_pool(geo.mamba_slots, st),
                          experts, st)

    def attach(self, scheduler, prefix_cache) -> None:
        """The holders of pages and slots: limits keep what they hold, shrinks relocate it."""
        self._scheduler, self._prefix = scheduler, prefix_cache

    # ----------------------------------------------------------------------------- state
    @property
    def geometry(self) -> Geometry:
        """What the pools really hold (derived, never stored)."""
        s = self.pools.sizes()
        return Geometry(s["moe"], s["kv"], s["mamba"])

    @property
    def total_experts(self) -> int:
        return self.shapes.total_experts

    @property
    def allocated_bytes(self) -> int:
        """The layout's bytes of the current geometry (what the allocator should hold)."""
        return self.layout.nbytes(self.geometry)

    def limits(self, held: bool = True) -> Limits:
        """Floors and ceilings of each pool now: the expert floor, the KV pages and mamba slots
        that running requests hold and the first waiting request will need (`held=False`: as if
        none ran); every expert, the context-independent maximum for the others."""
        sched = self._scheduler
        running = sched.running if held and sched else []
        waiting = sched.waiting if held and sched else []
        held_pages = len({p for s in running for p in s.pages})
        waiting_pages = max((self.pools.kv.pages_for(s.num_tokens + 1) for s in waiting), default=0)
        held_pages = max(held_pages, waiting_pages)
        resident = self.opts.moe_backend == "resident"
        moe_floor = self.total_experts if resident else self.expert_floor
        return Limits(
            floor={"moe": moe_floor, "kv": max(1, held_pages) * self.shapes.page_size,
                   "mamba": max(1, len(running))},
            ceiling={"moe": self.total_experts, "kv": 2**62, "mamba": 2**31},
            floor_why={"moe": "every expert, which the resident backend keeps" if resident else "the expert floor",
                       "kv": "the KV that running and next waiting requests hold" if held_pages else "one page",
                       "mamba": "the slots running requests hold" if running else "one slot"},
            ceiling_why={"moe": "the experts the model has"},
        )

    def reachable_ranges(self) -> dict[str, tuple[int, int]]:
        settled = self.settled_geometry
        ranges = reachable_ranges(settled, self.layout, self.budget.budget_bytes, self.limits())
        return ranges if self.peers is None else self.peers.joint_ranges(ranges)

    def ranges_around(self, moe: int | None = None, kv: int | None = None, mamba: int | None = None
                      ) -> dict[str, tuple[int, int]]:
        """Each pool's reachable range with the other pools at these targets (None: current size)."""
        return ranges_around(self.settled_geometry, self.target(moe, kv, mamba), self.layout,
                             self.budget.budget_bytes, self.limits())

    @property
    def settled_geometry(self) -> Geometry:
        """The geometry once a loan is recalled (`recall`: the expert slots the budget alone leaves), else
        the current one: what every plan, range and resize starts from, since a resize recalls first."""
        g = self.geometry
        if not self.lent:
            return g
        return Geometry(self.moe_beside(g.kv_tokens) or g.moe_slots, g.kv_tokens, g.mamba_slots)

    def moe_beside(self, kv_tokens: int, lent_bytes: int = 0, mamba_slots: int | None = None) -> int | None:
        """Expert slots for a geometry with `kv_tokens` of KV and `mamba_slots` (None: as now): all the
        budget plus `lent_bytes` of the loan (`lend`) leaves, or the fixed count of the resident backend /
        an explicit --moe-cache-size. None when that is below the expert floor or does not fit."""
        g, budget = self.geometry, self.budget.budget_bytes + lent_bytes
        mamba = g.mamba_slots if mamba_slots is None else mamba_slots

        def fits(moe: int) -> bool:
            return self.layout.nbytes(Geometry(moe, kv_tokens, mamba)) <= budget

        if self.opts.moe_backend == "resident" or self.opts.moe_cache_size is not None:
            return g.moe_slots if fits(g.moe_slots) else None
        moe = self.layout.largest("moe", fits, 0, self.total_experts)
        if self.peers is not None and not self.peers.fits_rung(kv_tokens):
            return None  # a worker rank could not keep its expert floor there
        return moe if moe >= max(1, self.expert_floor) else None

    # ----------------------------------------------------------------------------- resizing
    def target(self, moe: int | None = None, kv: int | None = None, mamba: int | None = None) -> Geometry:
        """The settled geometry (`settled_geometry`) with the given sizes (KV rounded to whole pages)."""
        g = self.settled_geometry
        return Geometry(g.moe_slots if moe is None else moe,
                        g.kv_tokens if kv is None else self.layout.round_size("kv", kv),
                        g.mamba_slots if mamba is None else mamba)

    def plan_resize(self, moe: int | None = None, kv: int | None = None, mamba: int | None = None,
                    held: bool = True) -> Plan:
        """The plan from the current geometry (after a recall: `settled_geometry`) to the target (None
        keeps a pool's size); with held=False, as if no request held pages or slots (would it fit once
        they finish?)."""
        return plan(self.settled_geometry, self.target(moe, kv, mamba), self.layout, self.budget.budget_bytes,
                    self.limits(held))

    def rebuild(self, moe: int | None = None, kv: int | None = None, mamba: int | None = None,
                trigger: str = "manual", reason: str | None = None) -> dict:
        """Resize the pools live (None keeps a pool). Returns the history entry.

        Raises RebuildRefused (nothing touched, recorded in history when the ladder asked) when
        the target is outside the reachable ranges, RebuildFailed after a rollback (the old
        geometry keeps serving; `degraded` when the rollback could not restore everything).
        """
        p = self.plan_resize(moe, kv, mamba)
        entry = self._entry(trigger, reason, p)
        if p.fits and self.lent:  # NOTE: every resize starts from the budget alone (what the ranges promise)
            self.recall(f"before a resize ({trigger})")
            p = self.plan_resize(moe, kv, mamba)
            entry = self._entry(trigger, reason, p)
        if not p.fits:
            err = RebuildRefused(p.reason, self.reachable_ranges())
            if trigger != "manual":  # a user's refused resize is answered to the user; the rest is history
                self._append({**entry, "status": "refused", "error": str(err)})
            raise err
        if p.target == p.current:
            return {**entry, "phases": {"total_s": 0.0}}
        try:
            entry["phases"] = {k: round(v, 6) for k, v in self.rebuilder.run(p).items()}
        except RebuildFailed as e:
            self._rolled_back(p, entry, e)
            if self.peers is not None:  # the workers move the contents this rank moved, and resize nothing
                self.peers.sync_ops(self.pools.kv.journal.take())
            self._append(entry)
            raise
        entry["measured_peak_bytes"] = self.rebuilder.measured_peak_bytes
        if self.peers is not None:
            self._rebuild_peers(p, moe, entry)
        if self.geometry != p.target:  # a bug, not a user error: say so loudly
            raise AssertionError(f"rebuild landed on {self.geometry} instead of {p.target}")
        if self.degraded and self.storage.held_bytes() <= self.allocated_bytes:
            self.degraded = None  # every pool was resized as a whole again
        self._append(entry)
        return entry

    def _rebuild_peers(self, p: Plan, moe: int | None, entry: dict) -> None:
        """The workers' part of a rebuild this rank made (`ft.engine.cache.tp_rebuild`): all commit,
        or every rank goes back to its geometry before it and RebuildFailed names the ranks' errors."""
        fill = moe is not None and self.opts.moe_backend != "resident" and moe == self.moe_beside(p.target.kv_tokens)
        answers = self.peers.resize(self.pools.kv.journal.take(), p.target.kv_tokens, p.target.mamba_slots,
                                    "fill" if fill else moe)
        entry["ranks"] = [{"rank": 0, "peak_bytes": entry["measured_peak_bytes"], "to": p.target.sizes()}] + [
            {"rank": a["rank"], "peak_bytes": a["peak_bytes"], "to": a["geometry"], "error": a["error"]}
            for a in answers]
        failed = [a for a in answers if not a["ok"]]
        if not failed:
            return
        errors = "; ".join(a["error"] for a in failed)
        restored = self.peers.restore()
        back = plan(self.geometry, p.current, self.layout, self.budget.budget_bytes, self.limits())
        try:
            self.rebuilder.run(back)
        except RebuildFailed as e:
            self.degraded = e.degraded or f"rank 0 could not go back to {p.current.sizes()}: {e}"
        bad = [a["error"] for a in restored if not a["ok"]]
        if bad:
            self.degraded = (self.degraded + "; " if self.degraded else "") + "; ".join(bad)
        entry.update(status="rolled_back" if not self.degraded else "degraded", error=errors,
                     to=self.geometry.sizes())
        self._append(entry)
        raise RebuildFailed("the worker ranks' resize", RuntimeError(errors), self.degraded)

    # ----------------------------------------------------------------------------- the prefill reserve's loan
    def lend(self, reason: str) -> dict | None:
        """Grow the expert slots into the whole loan (`SizingOptions.loan_bytes`: the part of the prefill
        reserve that short prompts never use) when they fill the budget and what is lent now (offloaded, no
        fixed size: not after a user's own --moe size) and the loan is not all out. A live rebuild (trigger
        "loan"), free before allocate; returns its history entry, None when there is nothing to do. A
        refused or failed grow leaves the geometry and `lent` as they were (recorded, not raised)."""
        g = self.geometry
        if not self.loan_bytes or self.lent >= self.loan_bytes or self.opts.moe_backend != "offload" \
                or self.opts.moe_cache_size or self.degraded or g.moe_slots != self.moe_beside(g.kv_tokens, self.lent):
            return None
        target = self.moe_beside(g.kv_tokens, self.loan_bytes)
        if target is None or target <= g.moe_slots:
            return None
        p = plan(g, Geometry(target, g.kv_tokens, g.mamba_slots), self.layout,
                 self.budget.budget_bytes + self.loan_bytes, self.limits())
        return self._run_loan(p, reason, self.loan_bytes)

    def recall(self, reason: str, keep: int = 0) -> dict | None:
        """Give the loan back, all of it or all but `keep` bytes: the expert slots shrink to what the budget
        (plus `keep`) leaves, their tail's experts forgotten (the hottest of them moved into colder kept
        slots first) and read again from the host store when next used, so that a long prefill chunk's
        activations find their reserve free. Returns the history entry (None: no more than `keep` is
        lent). Raises RebuildFailed when the shrink failed and was rolled back (the loan is still out)."""
        keep = max(0, min(keep, self.lent))
        if self.lent <= keep:
            return None
        g = self.geometry
        target = self.moe_beside(g.kv_tokens, keep) or g.moe_slots
        p = plan(g, Geometry(target, g.kv_tokens, g.mamba_slots), self.layout, self.budget.budget_bytes + self.lent,
                 self.limits())
        entry = self._run_loan(p, reason, keep)
        if entry["status"] != "ok":
            raise RebuildFailed("recall the prefill reserve's loan", RuntimeError(entry["error"]), self.degraded)
        return entry

    def _run_loan(self, p: Plan, reason: str, lent_after: int) -> dict:
        """Run a lend or recall plan (only the expert slots change); `lent` becomes `lent_after` when it ran."""
        entry = self._entry("loan", reason, p)
        if not p.fits:
            entry.update(status="refused", error=p.reason)
        else:
            try:
                entry["phases"] = {k: round(v, 6) for k, v in self.rebuilder.run(p).items()}
                entry["measured_peak_bytes"] = self.rebuilder.measured_peak_bytes
                self.lent = lent_after
            except RebuildFailed as e:
                self._rolled_back(p, entry, e)
        self._append(entry)
        return entry

    def _rolled_back(self, p: Plan, entry: dict, e: RebuildFailed) -> None:
        """After a plan's run failed and rolled back: `degraded` when the pools are not where the plan
        started, and the history entry's status, error and sizes."""
        self.degraded = e.degraded if e.degraded or self.geometry == p.current else (
            f"the pools hold {self.geometry.sizes()} after the rollback, not {p.current.sizes()}")
        entry.update(status="rolled_back" if not self.degraded else "degraded", error=str(e),
                     measured_peak_bytes=self.rebuilder.measured_peak_bytes, to=self.geometry.sizes())

    def record(self, trigger: str, reason: str, status: str, error: str | None = None) -> dict:
        """A history entry for a decision that did not resize (a ladder move refused or held)."""
        g = self.geometry.sizes()
        entry = {"id": len(self.history), "time": time.time(), "trigger": trigger, "reason": reason,
                 "from": g, "to": g, "peak_bytes": self.allocated_bytes, "status": status, "error": error,
                 "phases": {"total_s": 0.0}}
        self._append(entry)
        return entry

    def _append(self, entry: dict) -> None:
        """Into the history, and one line into the server log (a refusal or rollback as a warning)."""
        self.history.append(entry)
        log.log(logging.INFO if entry["status"] == "ok" else logging.WARNING, "%s", history_line(entry))

    def _entry(self, trigger: str, reason: str | None, p: Plan) -> dict:
        return {"id": len(self.history), "time": time.time(), "trigger": trigger, "reason": reason,
                "from": p.current.sizes(), "to": p.target.sizes(), "peak_bytes": p.peak_bytes,
                "status": "ok", "error": None, "phases": {}}

    # ----------------------------------------------------------------------------- reports
    def describe(self) -> dict:
        """Budget, unit costs, layout and geometry (printed by the CLI, served by the admin API)."""
        lay = self.layout
        return {
            "budget": self.budget.__dict__,
            "unit_costs": lay.unit_costs().__dict__,
            "storage": {"backend": lay.backend, "granularity_bytes": lay.granularity,
                        "reallocates": lay.reallocates, "held_bytes": self.storage.held_bytes()},
            "geometry": self.geometry.__dict__,
            "loan": {"bytes": self.loan_bytes, "lent_bytes": self.lent},
            "expert_floor": self.expert_floor,
            "total_experts": self.total_experts,
            "degraded": self.degraded,
        }
