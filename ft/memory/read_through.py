"""Offloaded decode inside the CUDA graph: the expert cache's host side of read-through caching.

During a decode step nothing waits for the host. Each MoE layer's lookup kernel
(`ft.kernels.expert_lookup`) turns routed experts into slots from the device slot table; a pair
whose expert has no slot reads it straight from the pinned host store (the MoE kernels' zero-copy
path), and the first such pair of each expert in the step also writes the bytes it read into a
*landing slot* that the host reserved for that layer before the step. So a miss costs one PCIe
read, not a read and a later copy, and it is cached for the next steps like an LRU cache's miss.

Around each step, on the one stream the graphs run on:
1. begin_step (just before the step is queued; the device is idle, so it is kept short): the
   spares chosen while the last step ran become this step's landing reserve, trimmed to the
   layer's misses of the last collected step plus a margin (at most `top_k x rows`); when short
   (the first step, or a cache under pressure whose last step left too few victims) the last step
   is collected first and the reserve topped up; then the landing table, the step number and the
   zeroed claim counters are uploaded, in one copy (`end_step` staged the table; views of one
   device tensor in the book).
2. end_step (right after the step is queued, while the device runs it):
   a. `commit_landed` is queued: on the device, after the step, every landed expert gets its
      landing slot in the slot table, so the next step hits it without waiting for the host;
   b. the previous step is collected (its readback arrived when the host waited for that step's
      token): the experts each layer used (last-use stamps), which expert landed where (the host
      mirrors the device's commit: the LRU map and the host twin of the table), the hit and miss
      counts; its unclaimed landing slots go back to the free list;
   c. this step's readback is queued (a small device-to-host copy after it);
   d. the next step's spares are chosen: free slots first, then victims chosen by the policy
      among the residents that the last collected step did not use, never taking a layer below
      its floor. A victim is unmapped (slot table -1) by an update queued after the running step,
      which may still read it; the step after, which may write into it, never sees it mapped.
      With `mapped_victims` (`--expert-mapped-victims`) it stays mapped instead, its slot in the
      reserve with an owner (`ExpertBook.owner`): the next step still hits it, and the lookup
      that claims the slot for a miss unmaps it, never while a pair reads it (a victim some real row
      routed this step in its layer or one before is not claimed). The reserve then costs no
      hits until it is used: the read-through LRU / LFU lose ~3 / ~1.5 points to an exact cache at
      2,008 slots with the victims unmapped a step early, and close most of that when mapped
      (bench/offload_policy.py).
So between two decode steps the host only uploads a reserve; what the policy learns from a step it
learns while the next one runs (one step later than the device, which commits at once).
`collect()` takes in the step in flight at once: before a prefill's `ensure`, a resize, an
invalidation, or a read of the statistics.

Why not copy promoted experts on a side stream (the issue's first sketch)? With a hit rate of
70-80% the misses already cross PCIe once, in the step, at the bus's speed; a promotion copy would
move the same bytes a second time, halving what the bus gives the critical path. Landing the bytes
the kernel already holds costs an HBM write instead.

Policies: "lru" (the default: least recently used by step, ties in the order they were last
touched) and "lfu" (least frequently used with aging: a score halved every `LFU_HALF_LIFE` steps
plus one per step an expert is used; ties by layer, then expert). bench/offload_policy.py compares them on
calibrated traces. The floor (`floor` residents per layer) keeps one layer's burst of misses from
emptying the others (the global LRU's cliff when the cache is smaller than a step's working set).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ft.kernels.expert_lookup import ExpertBook, commit_landed, new_book

POLICIES = ("lru", "lfu")
LFU_HALF_LIFE = 16.0
LANDING_MARGIN = 2
"""Landing slots kept per layer beyond its misses of the last step."""
_NOT_A_CANDIDATE = 1e30
"""Added to the "lfu" score of a resident that may not be a victim (finite, so a zero score times it stays
exact; aged scores stay below 1 / (1 - 0.5 ** (1 / LFU_HALF_LIFE)), about 23.6)."""


class ReadThrough:
    """The host policy and the device book of an `ExpertCache` in read-through mode.

    Contract with the model runner: `begin_step(rows, top_k)` just before a decode step is queued
    (eagerly or as a graph replay); `end_step()` just after it, before the step's end-of-step
    synchronization (which the next step's `end_step` or `collect` relies on); `collect()` before
    anything other than a read-through decode step uses the cache (a prefill, a rebuild). Slots are
    in exactly one place: resident (`cache.slot_of`), free (`cache.release_slots`), this step's landing
    reserve (`landing`), the step in flight's reserve (`pending`) or the next step's spares (`spare`);
    with `mapped_victims` a reserved slot may also still be resident, its victim's (`_owner`).
    """

    def __init__(self, cache, landing_capacity: int, policy: str = "lru", floor: int | None = None,
                 mapped_victims: bool = False) -> None:
        if policy not in POLICIES:
            raise ValueError(f"expert policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.cache, self.policy, self.mapped_victims = cache, policy, mapped_victims
        layers, experts = cache.num_layers, cache.num_experts
        device = cache.slot_table.device
        self.book: ExpertBook = new_book(layers, experts, landing_capacity, device)
        self.capacity = self.book.landing_capacity
        self.floor = floor if floor is not None else max(1, min(16, cache.num_slots // (4 * layers)))
        pin = device.type == "cuda"
        i32 = torch.int32

        def host(shape, dtype=i32, fill=0):
            return torch.full(shape, fill, dtype=dtype, pin_memory=pin)

        # readback targets (pinned): filled by end_step's copies, read by collect
        self._last = host((layers, experts), fill=-1)
        self._landed = host((layers, self.capacity), fill=-1)
        self._counters = host((layers, 2), torch.int64)
        # the book's inputs (step and rows, claim counters, landing table) as views of one device
        # tensor, so that begin_step uploads them in one copy; its pinned staging is a ring of three:
        # end_step of step N writes step N+1's landing table into the buffer step N-2 read, whose
        # upload has run (under overlapped decode step N-1 may not have started yet)
        lr = layers * self.capacity
        self._inputs = torch.zeros(2 + layers + 3 * lr, dtype=i32, device=device)
        self._inputs[2 + layers:] = -1
        tables = self._inputs[2 + layers:].view(3, layers, self.capacity)
        self.book = self.book._replace(step=self._inputs[:2], landing_used=self._inputs[2:2 + layers],
                                       landing=tables[0], owner=tables[1], landed=tables[2])
        self._up = [host((2 + layers + 3 * lr,)) for _ in range(3)]
        self._up_np = [t.numpy() for t in self._up]
        self._up_next = 0  # the buffer the next begin_step uploads
        self._staged = False  # whether that buffer holds the spares' landing table (end_step wrote it)
        self._updates = _Staging(device)
        # recorded after a step's readback copy, waited on before the next collect (public: a test stands a slow
        # device in for it)
        self.readback_event = torch.cuda.Event() if device.type == "cuda" else None
        self.landing: list[list[int]] = [[] for _ in range(layers)]  # reserved slots per layer, in upload order
        self.pending: list[list[int]] = [[] for _ in range(layers)]  # the step in flight's reserve, until collected
        self.spare: list[list[int]] = [[] for _ in range(layers)]  # chosen for the next step's reserve
        self._owner: dict[int, tuple[int, int]] = {}  # mapped_victims: reserved slot -> the resident it still holds
        self._rows = self._top_k = 1
        self.step = 0  # the next step's number
        self._in_flight: int | None = None  # the step whose readback collect has not taken yet
        self._seen = np.zeros((layers, 2), dtype=np.int64)  # counters already counted
        self.misses_last = np.zeros(layers, dtype=np.int64)
        self.used_last = np.zeros((layers, experts), dtype=bool)
        self.score = np.zeros((layers, experts), dtype=np.float64)  # "lfu": aged use counts
        self.landed_total = 0
        self.early_collects = 0  # begin_steps that collected the step before (short of spares)
        self._untouched: tuple | None = None  # the last collected step's (uses, hits), not yet applied (`touch`)
        self.active = False  # between begin_step and end_step: the MoE layers take the read-through path
        self.host_s = 0.0  # seconds spent in begin_step and end_step but waiting (the policy's share of a step's host time)
        self.wait_s = 0.0  # seconds a collect waited for the step before's readback (the device's time, not the host's)

    # ------------------------------------------------------------------------------ the step
    def begin_step(self, rows: int, top_k: int) -> None:
        """Reserve landing slots and upload the book's inputs for the decode step about to be
        queued (`rows` real rows of `top_k` experts per layer). Does not collect the step before
        (its record is taken in at `end_step`, while this step runs)."""
        t0, w0 = time.perf_counter(), self.wait_s
        table: list[tuple[int, int, int]] = []
        self.landing, self.spare = self.spare, self.landing  # the spares chosen while the last step ran
        for slots in self.spare:
            self._give_back(slots)  # NOTE: empty unless a step was reserved for and never ended
        most = min(self.capacity, top_k * rows)
        want = np.minimum(most, self.misses_last + LANDING_MARGIN)
        if self._in_flight is not None and any(len(s) < w for s, w in zip(self.landing, want.tolist())):
            # NOTE: short of spares (a cache under pressure: the running step's uses left too few
            # victims): take in the last step first, so that the victims topped up here avoid what
            # it used and its unclaimed reserve is free again (what every step did before the
            # collect moved off the critical path; at batch 8 on one 16 GiB card skipping it cost
            # 4 points of hit rate)
            self.collect()
            self.early_collects += 1
        changed = self._provision(most, table, self.landing)  # normally nothing to do
        self._apply(table)
        if changed or not self._staged:
            self._stage(self.landing)
        up = self._up_np[self._up_next]
        up[0], up[1] = self.step, rows
        self._inputs.copy_(self._up[self._up_next], non_blocking=True)  # step, zeroed claims, landing table
        self._up_next = (self._up_next + 1) % len(self._up)
        self._staged = False
        self._rows, self._top_k = rows, top_k
        self.active = True
        self.host_s += time.perf_counter() - t0 - (self.wait_s - w0)

    def end_step(self) -> None:
        """After the step is queued: its landed experts mapped on the device, the step before it
        collected, its readback queued, the next step's spares chosen (the module docstring)."""
        t0, w0 = time.perf_counter(), self.wait_s
        b = self.book
        commit_landed(self.cache.slot_table, b)
        self.collect()  # NOTE: the step before this one: its readback is in (its token was waited for)
        for dst, src in ((self._last, b.last_use), (self._landed, b.landed),
                         (self._counters, b.counters)):
            dst.copy_(src, non_blocking=True)
        if self.readback_event is not None:
            self.readback_event.record()
        self.active = False
        self._in_flight = self.step
        self.pending, self.landing = self.landing, self.pending  # (pending was emptied by the collect)
        self.step += 1
        # NOTE: the next step's spares are chosen now, while the device runs this step (the host
        # would otherwise do it between steps, on the critical path). Victims are unmapped by an
        # update queued after this step, so this step may still read them; the next one lands in them.
        table: list[tuple[int, int, int]] = []
        self._provision(min(self.capacity, self._top_k * self._rows), table, self.spare)
        self._apply(table)
        self._stage(self.spare)  # NOTE: into the buffer two steps before this one uploaded (it has run)
        self.host_s += time.perf_counter() - t0 - (self.wait_s - w0)

    def _stage(self, lists: list[list[int]]) -> None:
        """The next upload's claim counters (zero), landing table (`lists`, -1 past each), the
        owners of its slots and the landed table (-1) in the staging buffer begin_step copies next;
        its step and rows are written there."""
        up = self._up_np[self._up_next]
        layers = len(lists)
        up[2:2 + layers] = 0
        landing, owner, _ = tables = up[2 + layers:].reshape(3, layers, self.capacity)
        tables.fill(-1)
        for layer, slots in enumerate(lists):
            if slots:
                landing[layer, : len(slots)] = slots
                if self._owner:
                    e = self.cache.num_experts
                    owner[layer, : len(slots)] = [k[0] * e + k[1] if (k := self._owner.get(s)) else -1 for s in slots]
        self._staged = True

    def _give_back(self, slots: list[int]) -> None:
        """Empty a reserve: its free slots go back to the free list, its victims stay resident."""
        for slot in slots:
            if self._owner.pop(slot, None) is None:
                self.cache.release_slots([slot])
        slots.clear()

    def collect(self) -> None:
        """Take in the step in flight's readback, if any: mirror its landings (already mapped on the
        device), note its uses for the policy, count; its unclaimed landing slots become free."""
        if self._in_flight is None:
            return
        step, self._in_flight = self._in_flight, None
        if self.readback_event is not None:
            t0 = time.perf_counter()
            self.readback_event.synchronize()  # NOTE: normally done already: the runner waits for each step's end
            self.wait_s += time.perf_counter() - t0
        cache = self.cache
        used = self._last.numpy() == step
        self.used_last = used
        # NOTE: recency and scores are updated by `touch`, off the critical path; the hits are the
        # residents among the uses, taken before the landed experts below join them
        self._untouched = (used, used & (cache.table_np >= 0))
        landed = self._landed.numpy().tolist()  # (Python ints: numpy scalars cost more a read than the list)
        n_landed = 0
        for layer, slots in enumerate(self.pending):
            if not slots:
                continue
            row = landed[layer]
            for i, slot in enumerate(slots):
                e = row[i]
                if e < 0:
                    continue  # unclaimed: given back below (a victim stays resident)
                victim = self._owner.pop(slot, None)
                if victim is not None:
                    cache.unmap(victim, device=False)  # (the lookup that claimed it unmapped it on the device)
                key = (layer, e)
                old = cache.slot_of(key)
                if old is not None:  # NOTE: cannot happen (a resident is no miss); the device's mapping wins
                    cache.release_slots([old])
                cache.map(key, slot)
                n_landed += 1
            self._give_back([s for i, s in enumerate(slots) if row[i] < 0])
            slots.clear()
        self.landed_total += n_landed
        counters = self._counters.numpy()
        delta = counters - self._seen
        self._seen = counters.copy()
        self.misses_last = delta[:, 1].copy()
        cache.stats.hits += int(delta[:, 0].sum())
        cache.stats.misses += int(delta[:, 1].sum())
        cache.stats.bytes_loaded += int(delta[:, 1].sum()) * cache.bytes_per_slot  # read over PCIe

    # ------------------------------------------------------------------------------ policy
    def touch(self) -> None:
        """Apply the last collected step's uses to the policy's order: its hits become the most
        recent (in layer, expert order), and "lfu" ages every score and adds one per use. Deferred
        from `collect` to the next choice of victims (normally in `end_step`, while the device runs)
        or the next load (`ExpertCache.ensure`), which are the only readers of that order."""
        pending, self._untouched = self._untouched, None
        if pending is None:
            return
        used, hits = pending
        # (flat indices, ascending: layer, then expert; `np.nonzero` of the 2-D mask cost ~10x more)
        layers, experts = np.divmod(np.flatnonzero(hits & (self.cache.table_np >= 0)), self.cache.num_experts)
        self.cache.mark_recent_many(zip(layers.tolist(), experts.tolist()))  # still resident
        if self.policy == "lfu":
            self.score *= 0.5 ** (1.0 / LFU_HALF_LIFE)
            self.score[used] += 1.0

    def _provision(self, most: int, table: list[tuple[int, int, int]], lists: list[list[int]]) -> bool:
        """Top each layer's list (the landing reserves, or the spares for the next step) up to
        min(most, misses last step + margin) slots: free slots first, then victims (unmapped: their
        updates go to `table`); surplus slots go back to the free list. Returns whether a list changed."""
        cache = self.cache
        want = np.minimum(most, self.misses_last + LANDING_MARGIN)
        short, changed = 0, False
        for layer, slots in enumerate(lists):
            w = int(want[layer])
            if len(slots) > w:
                self._give_back(slots[w:])
                del slots[w:]
                changed = True
            short += w - len(slots)
        if short <= 0:
            return changed
        victims = self._victims(max(0, short - cache.num_free_slots))
        for layer, slots in enumerate(lists):
            for _ in range(int(want[layer]) - len(slots)):
                if cache.num_free_slots:
                    slots.append(cache.take_free_slot())
                elif victims:
                    key = victims.pop()
                    if self.mapped_victims:  # it stays a hit until a miss claims its slot
                        slot = cache.slot_of(key)
                        self._owner[slot] = key
                        slots.append(slot)
                    else:
                        slots.append(cache.unmap(key, device=False))
                        table.append((key[0], key[1], -1))
                else:
                    return True
                changed = True
        return changed

    def _victims(self, n: int) -> list[tuple[int, int]]:
        """Up to n residents to evict, the best victim last: not used by the last step, never
        taking a layer below the floor; by recency ("lru") or by aged use count ("lfu")."""
        if n <= 0:
            return []
        self.touch()
        cache = self.cache
        resident = cache.table_np >= 0
        used = self.used_last
        if self._owner:  # victims already reserved (still mapped) are going: neither chosen again nor counted
            ls, es = zip(*self._owner.values())
            resident = resident.copy()
            resident[list(ls), list(es)] = False
            used = used | ~resident
        count = resident.sum(axis=1)
        out: list[tuple[int, int]] = []
        if self.policy == "lru":
            for key in cache.residents_oldest_first():
                if len(out) >= n:
                    break
                layer = key[0]
                if used[key] or count[layer] <= self.floor:
                    continue
                count[layer] -= 1
                out.append(key)
        else:
            # the lowest aged scores among residents the last step did not use (ties: layer, then
            # expert); a partial sort of the candidates up to the m-th lowest score, every one tied
            # with it included (so that the order among ties is exact), all of them if the floor skips many.
            # NOTE: flat arrays and a penalty instead of a masked copy: `np.nonzero` of the 2-D mask and
            # `np.where` on a random mask each cost ~80-140 us at 48 x 512 (branchy), the sum ~20
            eligible = (resident & ~used).ravel()
            total = int(np.count_nonzero(eligible))
            scores = self.score.ravel() + (~eligible) * _NOT_A_CANDIDATE
            experts = cache.num_experts
            floor, counts0 = self.floor, count.tolist()
            for m in (min(total, 4 * n + 64), total):
                if m <= 0:
                    break
                if m < total:
                    cand = np.flatnonzero(scores <= np.partition(scores, m - 1)[m - 1])
                else:
                    cand = np.flatnonzero(eligible)
                out.clear()
                counts = list(counts0)
                for i in cand[np.argsort(scores[cand], kind="stable")].tolist():  # by score, then flat index
                    if len(out) >= n:
                        break
                    layer = i // experts
                    if counts[layer] <= floor:
                        continue
                    counts[layer] -= 1
                    out.append((layer, i - layer * experts))
                if len(out) >= n:
                    break
        out.reverse()
        return out

    # ------------------------------------------------------------------------------ device
    def _apply(self, table: list[tuple[int, int, int]]) -> None:
        """slot_table[layer, expert] = slot for each update, in one launch (queued on the stream)."""
        if table:
            e = self.cache.num_experts
            flat = [layer * e + expert for layer, expert, _ in table]
            values = [slot for _, _, slot in table]
            idx, val = self._updates.load(flat, values)
            self.cache.slot_table.view(-1).index_put_((idx,), val)

    def release_landing(self) -> list[int]:
        """Empty every landing reserve (a resize or an invalidation); returns the slots."""
        self.collect()
        out = [s for slots in self.landing + self.spare for s in slots if s not in self._owner]
        for slots in self.landing + self.spare:
            for s in slots:
                self._owner.pop(s, None)  # a victim stays resident
            slots.clear()
        self._staged = False
        return out

    def reset(self) -> None:
        """After the cache forgot every expert (`invalidate`): no reserves, nothing outstanding."""
        self._in_flight = None
        self._untouched = None
        for slots in self.landing + self.pending + self.spare:
            slots.clear()
        self._owner.clear()
        self._staged = False
        self.used_last[:] = False
        self.misses_last[:] = 0


class _Staging:
    """Pinned host staging for (index, value) int64 pairs, grown as needed; one copy each to the device.

    The host side is a ring of `RING` buffers, each with the event of its last copy: a load writes
    the buffer whose copy was queued `RING` loads ago, which has run, so the host never waits for a
    step in flight. (One buffer made every load wait for the last one's copy, queued after the step
    before: harmless when the host waits for each step's token anyway, but under overlapped decode
    it held the next step's launch until the step in flight had ended.) The device side needs one
    buffer: its readers are queued on the same stream, before the next copy into it."""

    RING = 4

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._next = 0
        self._alloc(256)

    def _alloc(self, n: int) -> None:
        pin = self.device.type == "cuda"
        for event in getattr(self, "_copied", []):  # NOTE: the old buffers are freed: no copy may still read them
            if event is not None:
                event.synchronize()
        self.host = [torch.zeros((2, n), dtype=torch.int64, pin_memory=pin) for _ in range(self.RING)]
        self.dev = torch.zeros((2, n), dtype=torch.int64, device=self.device)
        self._copied = [torch.cuda.Event() if pin else None for _ in range(self.RING)]

    def load(self, idx: list[int], val: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(idx)
        if n > self.dev.shape[1]:
            self._alloc(2 * n)
        i = self._next
        self._next = (i + 1) % self.RING
        host, copied = self.host[i], self._copied[i]
        if copied is not None:  # NOTE: its copy was queued RING loads ago (normally done: returns at once)
            copied.synchronize()
        h = host.numpy()
        h[0, :n], h[1, :n] = idx, val
        d = self.dev[:, :n]
        d.copy_(host[:, :n], non_blocking=True)
        if copied is not None:
            copied.record()
        return d[0], d[1]
