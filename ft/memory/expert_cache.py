"""Routed experts: every expert in a host store, N device slots, an LRU map (layer, expert) -> slot.

The host store holds each MoE layer's experts stacked ([L, E, ...], pinned on CUDA). The device
keeps `num_slots` slots in the same format (`SlotWeights`), and `slot_table` [L, E] (int64, -1
when absent) turns router expert ids into slot ids on the device. With the resident backend
there is one slot per expert and nothing is ever evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ft.memory.resizable import PoolInconsistent, follow_free_slots, narrow_to_common, resize_together
from ft.memory.storage import PoolStorage
from ft.kernels.moe import SlotWeights


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    bytes_loaded: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ExpertCache:
    """LRU cache of expert slots over a host store (`host`: SlotWeights with [L, E] leading dims)."""

    def __init__(
        self, host: SlotWeights, num_slots: int, device: torch.device, policy: str = "lru",
        storage: PoolStorage | None = None,
    ) -> None:
        self.host = host
        self.num_layers, self.num_experts = host.w13.shape[:2]
        if num_slots < 1:
            raise ValueError("expert cache needs at least one slot")
        self.policy = policy
        self.storage = storage or PoolStorage(device)
        self.slots = SlotWeights(
            *(None if t is None else self.storage.empty(num_slots, tuple(t.shape[2:]), t.dtype) for t in host)
        )
        self.slot_table = torch.full((self.num_layers, self.num_experts), -1, dtype=torch.int64, device=device)
        self.table_np = np.full((self.num_layers, self.num_experts), -1, dtype=np.int64)  # host twin of slot_table
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self.stats = ExpertStats()
        self.read_through = None  # a `ReadThrough` (offloaded decode inside the graph), see `enable_read_through`
        self.prefill_stream = None  # a `PrefillStream` (long prefill chunks' misses staged), see `enable_prefill_stream`

    # ----------------------------------------------------------------------------- geometry
    @property
    def num_slots(self) -> int:
        return self.slots.w13.shape[0]

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def tensors(self) -> list[torch.Tensor]:
        """The slot tensors, each [S, ...] (what the pool's bytes are made of)."""
        return [t for t in self.slots if t is not None]

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.slots if t is not None)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.bytes_per_slot

    @property
    def num_resident(self) -> int:
        return len(self._lru)

    @property
    def all_resident(self) -> bool:
        """Every expert of every layer is in a slot (the resident backend, or a cache that big)."""
        return len(self._lru) == self.total_experts

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._lru

    # ------------------------------------------------------------------ slot bookkeeping (read-through)
    def slot_of(self, key: tuple[int, int]) -> int | None:
        """The slot resident `key` (layer, expert) holds, None when it is not resident."""
        return self._lru.get(key)

    def mark_recent_many(self, keys) -> None:
        """Each resident of `keys` (an iterable of (layer, expert)) becomes the most recent, in the order given."""
        move = self._lru.move_to_end
        for key in keys:
            move(key)

    def resident_slots(self) -> dict[tuple[int, int], int]:
        """A copy of {(layer, expert): slot} of the residents, least recently used first."""
        return dict(self._lru)

    def residents_oldest_first(self):
        """The resident keys, least recently used first (an iterator over the live order: do not
        map or unmap while iterating)."""
        return iter(self._lru)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def take_free_slot(self) -> int:
        """A free slot, now the caller's (IndexError when none is free)."""
        return self._free.pop()

    def release_slots(self, slots) -> None:
        """Slots the caller held (taken free, or unmapped) are free again."""
        self._free.extend(slots)

    def enable_read_through(self, landing_capacity: int, policy: str | None = None,
                            mapped_victims: bool = False) -> None:
        """Offloaded decode without host syncs (`ft.memory.read_through.ReadThrough`): misses read
        the host store in place and land in reserved slots, bookkeeping on the device between
        steps. `landing_capacity`: at most this many landing slots per layer per step;
        `mapped_victims`: a victim stays mapped (a hit) until a miss claims its slot."""
        from ft.memory.read_through import ReadThrough  # NOTE: a part of the cache, in its own file

        self.read_through = ReadThrough(self, landing_capacity, policy or self.policy,
                                        mapped_victims=mapped_victims)

    def enable_prefill_stream(self, page_experts: int, pages: int | None = None, min_tokens: int = 1,
                              loader: str = "auto") -> None:
        """Long prefill chunks stream the experts this cache lacks through staging pages instead of
        landing them (`ft.memory.prefill_stream.PrefillStream`): chunks of at least `min_tokens`
        tokens; `pages` pages (default `PAGES`) of `page_experts` slots, allocated here, filled by
        `loader` (one of `prefill_stream.LOADERS`)."""
        from ft.memory.prefill_stream import PAGES, PrefillStream  # NOTE: a part of the cache, in its own file

        self.prefill_stream = PrefillStream(self, page_experts, pages or PAGES, min_tokens, loader)

    def collect(self) -> None:
        """Take in what the last offloaded decode step did on the device (landed experts, uses,
        hit counts); a no-op without read-through or when nothing is outstanding. Callers run it
        before anything else uses the cache in a step."""
        if self.read_through is not None:
            self.read_through.collect()

    # ----------------------------------------------------------------------------- residency
    def preload_all(self) -> None:
        """Load every expert (resident backend). Needs one slot per expert."""
        if self.num_slots < self.total_experts:
            raise ValueError(f"preload_all needs {self.total_experts} slots, have {self.num_slots}")
        for layer in range(self.num_layers):
            self.ensure(layer, list(range(self.num_experts)), count=False)

    def ensure(self, layer: int, experts: list[int], count: bool = True) -> None:
        """Make the distinct `experts` of `layer` resident, evicting least recently used others.

        The policy, exactly (`ft.tools.routing_trace.lru_hit_rate` replays it): the residents among
        `experts` become the most recent, in the order given; then each missing one, in the order
        given, takes a free slot or the least recently used slot that this call does not use.
        Contract: len(experts) <= num_slots (callers split larger sets into groups).
        """
        if len(experts) > self.num_slots:
            raise ValueError(f"{len(experts)} experts asked at once, cache has {self.num_slots} slots")
        if self.read_through is not None:
            self.read_through.touch()  # the last decode step's uses, before this call reorders
        keys = list(dict.fromkeys((layer, e) for e in experts))  # distinct, in the order given
        wanted = set(keys)
        for key in keys:
            if key in self._lru:
                self._lru.move_to_end(key)
                if count:
                    self.stats.hits += 1
        for key in keys:
            if key in self._lru:
                continue
            slot = self._take_slot(wanted)
            self._load(key, slot)
            if count:
                self.stats.misses += 1

    def _take_slot(self, keep: set[tuple[int, int]]) -> int:
        if not self._free and self.read_through is not None:
            # NOTE: landing reserves are free slots set aside for the next decode step, which
            # reserves again before it runs: a load between steps may have them first
            self._free.extend(self.read_through.release_landing())
        if self._free:
            return self._free.pop()
        for key in self._lru:  # oldest first
            if key not in keep:
                return self.unmap(key)
        raise RuntimeError("expert cache: every slot is pinned by the current call")

    def _load(self, key: tuple[int, int], slot: int) -> None:
        layer, expert = key
        for dst, src in zip(self.slots, self.host):
            if dst is not None:
                dst[slot].copy_(src[layer, expert], non_blocking=True)
                self.stats.bytes_loaded += src[layer, expert].numel() * src.element_size()
        self.map(key, slot)
        self.slot_table[layer, expert] = slot

    def map(self, key: tuple[int, int], slot: int) -> None:
        """Host side of making `key` resident in `slot` (the most recent); the caller writes slot_table."""
        self._lru[key] = slot
        self.table_np[key] = slot

    def unmap(self, key: tuple[int, int], device: bool = True) -> int:
        """Forget resident `key`; returns its slot. With `device`, slot_table's entry is cleared now
        (one small launch), else the caller clears it (in a batch of updates)."""
        slot = self._lru.pop(key)
        self.table_np[key] = -1
        if device:
            self.slot_table[key] = -1
        return slot

    def invalidate(self) -> None:
        """Forget every resident expert (slots keep their bytes but are free)."""
        self.collect()
        self.slot_table.fill_(-1)
        self.table_np.fill(-1)
        self._lru.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        if self.read_through is not None:
            self.read_through.reset()

    def resize(self, num_slots: int) -> None:
        """Grow or shrink to `num_slots`. Experts in kept slots stay resident; those in cut slots
        are forgotten first (loaded again from the host store when next used). Every slot tensor
        changes or none does (PoolInconsistent when even putting back failed: the cache then
        narrows to the slots all of them have)."""
        if num_slots < 1:
            raise ValueError("expert cache needs at least one slot")
        old = self.num_slots
        self.collect()
        if self.read_through is not None:  # landing reservations go back to the free slots
            self._free.extend(self.read_through.release_landing())
        if num_slots < old:
            self._keep_hottest(num_slots)
        for key, slot in list(self._lru.items()):
            if slot >= num_slots:
                self.unmap(key)
                self._free.append(slot)
        names = [i for i, t in enumerate(self.slots) if t is not None]
        ts = [self.slots[i] for i in names]
        try:
            resize_together(self.storage, ts, num_slots, "moe")
        except PoolInconsistent:
            ts = narrow_to_common(ts)
            raise
        finally:
            new = list(self.slots)
            for i, tensor in zip(names, ts):
                new[i] = tensor
            self.slots = SlotWeights(*new)
            self._follow(old)

    MOVE_BATCH = 64
    """Slots a shrink's relocation copies at once at most (`_keep_hottest`)."""
    MOVE_BYTES = 64 << 20
    """And at most this many bytes of one slot tensor at once: the relocation's temporary (the rows read
    before they are written), from torch's allocator. A shrink runs between steps, when the activation
    reserve (hundreds of MB at the smallest prefill chunk) is idle in that allocator's cache, so the
    temporary comes out of it, outside the pools' planned peak."""

    def heat(self) -> dict[tuple[int, int], float]:
        """Each resident's worth keeping, higher hotter: its aged use count under the read-through's
        LFU policy, else its recency (the LRU order)."""
        rt = self.read_through
        if rt is not None and rt.policy == "lfu":
            return {key: float(rt.score[key]) for key in self._lru}
        return {key: float(i) for i, key in enumerate(self._lru)}

    def _keep_hottest(self, num_slots: int) -> None:
        """Before a shrink to `num_slots`: the hottest residents of the slots to be cut move into the free
        kept slots, then into those of colder kept residents (forgotten), so that the shrink forgets the
        coldest experts, not the ones that happen to sit high (the expert slots trade for KV on a ladder
        move, for a long prefill with --lend-prefill-reserve). Device copies in batches of MOVE_BATCH
        slots (fewer where MOVE_BYTES says), queued on the stream; slot_table follows in one update."""
        cut = [(key, slot) for key, slot in self._lru.items() if slot >= num_slots]
        if not cut:
            return
        heat = self.heat()
        cut.sort(key=lambda kv: -heat[kv[0]])
        free_low = [slot for slot in self._free if slot < num_slots]
        cold = sorted(((key, slot) for key, slot in self._lru.items() if slot < num_slots), key=lambda kv: heat[kv[0]])
        moves: list[tuple[tuple[int, int], int, int]] = []  # (key, from slot, to slot)
        forgotten: list[tuple[int, int]] = []
        for key, src in cut:
            if free_low:
                dst = free_low.pop()
                self._free.remove(dst)
            elif len(forgotten) < len(cold) and heat[cold[len(forgotten)][0]] < heat[key]:
                victim, dst = cold[len(forgotten)]
                forgotten.append(victim)
                self.unmap(victim, device=False)
            else:
                break  # the rest of the cut are colder than every kept resident
            moves.append((key, src, dst))
        if not moves:
            return
        device = self.slot_table.device
        row_bytes = max(t[0].numel() * t.element_size() for t in self.slots if t is not None)
        batch = max(1, min(self.MOVE_BATCH, self.MOVE_BYTES // row_bytes))
        for i in range(0, len(moves), batch):
            part = moves[i:i + batch]
            src = torch.tensor([m[1] for m in part], device=device)
            dst = torch.tensor([m[2] for m in part], device=device)
            for t in self.slots:
                if t is not None:  # (one-byte codes and fp8 scales as bytes: index_copy_ has no fp8 kernels)
                    raw = t.view(torch.uint8) if t.element_size() == 1 else t
                    raw.index_copy_(0, dst, raw.index_select(0, src))
        for key, src, dst in moves:
            self._lru[key] = dst  # (keeps its place in the recency order)
            self.table_np[key] = dst
        self._free.extend(m[1] for m in moves)  # the cut slots they left (dropped by the shrink)
        keys = [m[0] for m in moves] + forgotten
        rows = torch.tensor([k[0] for k in keys], device=device)
        cols = torch.tensor([k[1] for k in keys], device=device)
        vals = torch.tensor([m[2] for m in moves] + [-1] * len(forgotten), dtype=self.slot_table.dtype, device=device)
        self.slot_table[rows, cols] = vals

    def _follow(self, old: int) -> None:
        self._free = follow_free_slots(self._free, old, self.num_slots)
