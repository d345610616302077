"""Rebuilds across the ranks of a tensor-parallel engine: all ranks commit, or all roll back.

Rank 0's cache manager plans and runs its own rebuild first (rollback-safe on its own, as on
one GPU). Then it orders every worker to resize to the same KV and mamba sizes, and its expert
slots to what its own budget leaves ("fill", the ladder's moves) or to the count asked. Each
worker runs the same rollback-safe executor on its pools. If any rank fails, the ranks that
succeeded go back to the geometry they had (a second order, "restore"), and rank 0 reports the
rebuild rolled back with each rank's error; the old geometry keeps serving everywhere.

Before resizing, a worker replays rank 0's pool content operations (`PoolJournal`): a shrink's
relocated pages and slots move the same way on every rank, even when the rebuild then fails.
"""

from __future__ import annotations

import logging

from ft.errors import RebuildFailed, RebuildRefused

log = logging.getLogger("ft.cache")


class TPPeers:
    """Rank 0's view of its worker ranks: ordering their rebuilds, asking their state."""

    def __init__(self, tp, describes: list[dict]) -> None:
        self.tp = tp
        self.describes = describes  # the last answer of each worker (rank 1..)
        self.fault_rank: int | None = None  # tests: this worker fails its next resize (an injected fault)

    def resize(self, ops: list[tuple], kv: int, mamba: int, moe) -> list[dict]:
        """Order every worker to replay `ops` and resize (moe: an int, "fill" or None to keep
        its own); returns their answers ({"rank", "ok", "error", "geometry", "peak_bytes"})."""
        order = {"ops": ops, "kv": kv, "mamba": mamba, "moe": moe, "restore": False}
        if self.fault_rank is not None:
            order["fault_rank"], self.fault_rank = self.fault_rank, None
        return self._order(order)

    def sync_ops(self, ops: list[tuple]) -> None:
        """Only `ops` (rank 0's rebuild failed after moving content): every rank stays in step."""
        if ops:
            self._order({"ops": ops, "kv": None, "mamba": None, "moe": None, "restore": False})

    def restore(self) -> list[dict]:
        """Every worker that resized goes back to its geometry before the last order."""
        return self._order({"ops": [], "kv": None, "mamba": None, "moe": None, "restore": True})

    def describe(self) -> list[dict]:
        """Every worker's `rank_report`, asked now (rank 0's engine thread only: a control message)."""
        self.tp.broadcast(("describe", None))
        self.describes = self.tp.gather(None)[1:]
        return self.describes

    def joint_ranges(self, ranges: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """Rank 0's reachable ranges narrowed by the workers' last reports: KV and mamba sizes are
        shared, so a size is reachable when every rank reaches it (expert slots are per rank)."""
        out = dict(ranges)
        for d in self.describes:
            for pool in ("kv", "mamba"):
                lo, hi = d["ranges"][pool]
                out[pool] = (max(out[pool][0], lo), min(out[pool][1], hi))
        return out

    def fits_rung(self, kv_tokens: int) -> bool:
        """Whether every worker keeps its expert floor beside `kv_tokens` of KV (for the KV ladder's
        rungs, which the workers report; other sizes are checked by the workers at the rebuild)."""
        return all(d["moe_beside"].get(kv_tokens, 0) is not None for d in self.describes)

    def _order(self, order: dict) -> list[dict]:
        self.tp.broadcast(("rebuild", order))
        answers = self.tp.gather(None)[1:]
        for a in answers:
            if a.get("describe") is not None:
                self.describes[a["rank"] - 1] = a["describe"]
        return answers


class NoHolders:
    """A worker's pools are referred to by nothing of its own: rank 0's sequences and prefix
    cache hold the pages and slots, and rank 0's journal moves their contents."""

    running: list = []
    waiting: list = []

    def evict_one(self) -> bool:
        return False

    def remap_pages(self, moves) -> None:
        pass

    def remap_slots(self, moves) -> None:
        pass


class WorkerCache:
    """A worker rank's cache manager as rank 0's orders see it: `report()` (what rank 0 needs to
    know of it) and `apply(order)` (its part of a rebuild; see the module docstring). The pools'
    holders are rank 0's (`NoHolders` here)."""

    def __init__(self, cache, rank: int, rungs: list[int] | None) -> None:
        self.cache, self.rank, self.rungs = cache, rank, rungs
        holders = NoHolders()
        cache.attach(holders, holders)
        self.before = None  # the geometry before the last resize order (what "restore" goes back to)

    def report(self) -> dict:
        return rank_report(self.cache, self.rungs)

    def apply(self, order: dict) -> dict:
        """Replay the order's pool operations, then resize or restore; returns the answer
        ({"rank", "ok", "error", "peak_bytes", "geometry", "describe"})."""
        from ft.engine.base.step_inputs import replay_pool_ops

        cache, rank = self.cache, self.rank
        pools = cache.pools
        answer = {"rank": rank, "ok": True, "error": None, "peak_bytes": None}
        try:
            replay_pool_ops(order["ops"], pools.kv, pools.mamba)
            if order["restore"]:
                before, self.before = self.before, None
                if before is not None and before != cache.geometry:
                    entry = cache.rebuild(moe=before.moe_slots, kv=before.kv_tokens, mamba=before.mamba_slots,
                                          trigger="tp", reason="rank 0 rolled the rebuild back")
                    answer["peak_bytes"] = entry.get("measured_peak_bytes")
            elif order["kv"] is not None:
                self.before = cache.geometry
                answer["peak_bytes"] = self._resize(order)
        except (RebuildFailed, RebuildRefused, MemoryError, RuntimeError) as e:
            answer.update(ok=False, error=f"rank {rank}: {e}")
        answer["geometry"] = cache.geometry.sizes()
        answer["describe"] = self.report()
        return answer

    def _resize(self, order: dict) -> int | None:
        cache, rank = self.cache, self.rank
        moe = order["moe"]
        if moe == "fill":
            moe = cache.moe_beside(order["kv"])
            if moe is None:
                raise RebuildRefused(f"rank {rank}: {order['kv']} KV tokens leave no room for the expert floor",
                                     cache.reachable_ranges())
        if order.get("fault_rank") == rank:
            cache.rebuilder.fault_at = "grow kv" if order["kv"] > cache.geometry.kv_tokens else "shrink kv"
        try:
            entry = cache.rebuild(moe=moe, kv=order["kv"], mamba=order["mamba"], trigger="tp",
                                  reason="ordered by rank 0")
        finally:
            cache.rebuilder.fault_at = None
        return entry.get("measured_peak_bytes")


def rank_report(cache, rungs: list[int] | None) -> dict:
    """What a worker tells rank 0 about its caches: `describe()`, its reachable ranges, the
    expert slots it keeps beside each KV ladder rung (None: below its expert floor) and its expert
    cache's counters."""
    experts = cache.pools.experts
    if experts is not None:
        experts.collect()  # NOTE: the last decode step's counters (read-through takes them in a step late)
    st = experts.stats if experts is not None else None
    return {**cache.describe(), "ranges": {k: list(v) for k, v in cache.reachable_ranges().items()},
            "moe_beside": {r: cache.moe_beside(r) for r in rungs or []},
            "experts": {"hits": st.hits, "misses": st.misses, "host_bytes": st.bytes_loaded} if st else None}
