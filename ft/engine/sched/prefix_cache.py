"""Prefix cache for a hybrid model: KV pages *and* the linear-attention state at the boundary.

A Gated DeltaNet layer can only resume from the recurrent state after exactly the cached tokens,
so an entry is (token prefix, the KV pages covering it, a mamba slot holding the state after
it). When a request finishes, its pages and its slot move into an entry covering every token it
fed through the model (no copy). A new request whose prompt starts with an entry's tokens
starts from there: full pages are shared (reference counted), the partial last page is copied
(the request writes into it), and the state is copied into the request's own slot.

Why whole-sequence boundaries rather than snapshots at every page boundary: the state is large
(77 MB per request for the flagship), and the case that matters, the next turn of a
conversation, always extends the previous turn's whole sequence.

With `host_entries` > 0 an entry keeps its state in pinned host memory instead of a device slot
(`MambaPool.save` when the request finishes, `restore` into the new request's slot on a hit: one
PCIe copy each way, ~2 ms for Qwen3.8-Flash-Next's 113 MB at the bus's speed), at most that many
entries: the device pool then needs only the running requests' slots, and what the entries held
goes to expert slots (`EngineConfig.prefix_host_entries`: by default when experts are offloaded on
one GPU, where a slot of state is worth ~40 expert slots).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from ft.memory.kv_pool import KVPool
from ft.memory.mamba_pool import MambaPool


@dataclass
class PrefixEntry:
    """A cached prefix: its KV pages and the linear-attention state after it, either in a device
    mamba slot (`mamba_slot`) or in host memory (`host_state`, `MambaPool.save`'s tensors)."""

    tokens: tuple[int, ...]
    pages: list[int]
    mamba_slot: int | None
    last_used: int = 0
    hits: int = field(default=0)
    host_state: list | None = None


@dataclass
class PrefixMatch:
    entry: PrefixEntry

    @property
    def num_tokens(self) -> int:
        return len(self.entry.tokens)


class PrefixCache:
    def __init__(self, kv: KVPool, mamba: MambaPool, enabled: bool = True, host_entries: int = 0) -> None:
        """`host_entries`: with it, every entry keeps its state in host memory, at most that many
        entries (0: each entry holds a device mamba slot, and the pool's free slots bound the entries)."""
        self.kv, self.mamba, self.enabled, self.host_entries = kv, mamba, enabled, host_entries
        self._entries: dict[tuple[int, ...], PrefixEntry] = {}
        self._clock = itertools.count(1)
        self.hit_tokens = 0
        self.query_tokens = 0
        self.host_failures = 0  # states host memory could not take (those prefixes were not cached)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_slots(self) -> int:
        """Device mamba slots the entries hold (none when their states are in host memory)."""
        return 0 if self.host_entries else len(self._entries)

    @property
    def host_bytes(self) -> int:
        """Host memory the entries' states take (`host_entries`)."""
        return sum(t.numel() * t.element_size() for e in self._entries.values() for t in e.host_state or ())

    def cached_only_pages(self) -> int:
        """KV pages that only the cache holds (no running request shares them): what it gives back
        when a request needs the room. A page may sit in several entries (a turn's entry shares the
        previous turn's full pages): it is the cache's alone when its references are all entries'."""
        held = Counter(p for e in self._entries.values() for p in e.pages)
        return sum(1 for p, n in held.items() if self.kv.refcount(p) == n)

    def match(self, prompt: list[int]) -> PrefixMatch | None:
        """The longest entry that is a proper prefix of `prompt` (one token must stay to compute)."""
        if not self.enabled:
            return None
        best: PrefixEntry | None = None
        n = len(prompt)
        for e in self._entries.values():
            m = len(e.tokens)
            if m < n and (best is None or m > len(best.tokens)) and tuple(prompt[:m]) == e.tokens:
                best = e
        return PrefixMatch(best) if best else None

    def apply(self, match: PrefixMatch, mamba_slot: int) -> list[int]:
        """Copy the entry's state into `mamba_slot` and return the request's pages for its tokens.

        Needs one free KV page when the entry ends inside a page (copy-on-write of that page).
        """
        e = match.entry
        e.last_used, e.hits = next(self._clock), e.hits + 1
        if e.host_state is not None:
            self.mamba.restore(e.host_state, mamba_slot)
        else:
            self.mamba.copy_slot(e.mamba_slot, mamba_slot)
        full = len(e.tokens) // self.kv.page_size
        pages = list(e.pages[:full])
        self.kv.ref(pages)
        if len(e.tokens) % self.kv.page_size:
            (own,) = self.kv.allocate(1)
            self.kv.copy_page(e.pages[full], own)
            pages.append(own)
        self.hit_tokens += len(e.tokens)
        return pages

    def insert(self, tokens: list[int], pages: list[int], mamba_slot: int) -> None:
        """Take ownership of `pages` (one reference each) and `mamba_slot` for the prefix `tokens`."""
        key = tuple(tokens)
        if not self.enabled or not key or key in self._entries:
            self.kv.release(pages)
            self.mamba.free(mamba_slot)
            if key in self._entries:
                self._entries[key].last_used = next(self._clock)
            return
        keep = self.kv.pages_for(len(key))
        self.kv.release(pages[keep:])
        if not self.host_entries:
            self._entries[key] = PrefixEntry(key, pages[:keep], mamba_slot, next(self._clock))
            return
        try:
            state = self.mamba.save(mamba_slot)  # queued before anything the freed slot runs next
        except RuntimeError:  # no pinned host memory left: the prefix is not cached, nothing else fails
            state = None
        self.mamba.free(mamba_slot)
        if state is None:
            self.kv.release(pages[:keep])
            self.host_failures += 1
            return
        while len(self._entries) >= self.host_entries:  # (every entry is a host one)
            self._drop(min(self._entries.values(), key=lambda x: x.last_used))
        self._entries[key] = PrefixEntry(key, pages[:keep], None, next(self._clock), host_state=state)

    def evict_one(self, protect: PrefixEntry | None = None, holding_slot: bool = False) -> bool:
        """Drop the least recently used entry other than `protect` (with `holding_slot`: among those
        that hold a device mamba slot). False when there is none."""
        candidates = [e for e in self._entries.values()
                      if e is not protect and (e.mamba_slot is not None or not holding_slot)]
        if not candidates:
            return False
        self._drop(min(candidates, key=lambda x: x.last_used))
        return True

    def evict_for(self, pages: int = 0, slots: int = 0, protect: PrefixEntry | None = None) -> bool:
        """Evict LRU entries (never `protect`) until `pages` KV pages and `slots` mamba slots are free."""
        while self.kv.num_free_pages < pages or self.mamba.num_free < slots:
            if not self.evict_one(protect, holding_slot=self.kv.num_free_pages >= pages):
                return False
        return True

    def remap_pages(self, moves: dict[int, int]) -> None:
        """Pages were relocated (a KV shrink): rewrite the entries' page lists."""
        for e in self._entries.values():
            e.pages = [moves.get(p, p) for p in e.pages]

    def remap_slots(self, moves: dict[int, int]) -> None:
        """Mamba slots were relocated (a mamba shrink)."""
        for e in self._entries.values():
            if e.mamba_slot is not None:
                e.mamba_slot = moves.get(e.mamba_slot, e.mamba_slot)

    def clear(self) -> None:
        for e in list(self._entries.values()):
            self._drop(e)

    def _drop(self, e: PrefixEntry) -> None:
        del self._entries[e.tokens]
        self.kv.release(e.pages)
        if e.mamba_slot is not None:
            self.mamba.free(e.mamba_slot)
        e.host_state = None  # pinned memory goes back to torch's host cache once its copies ran
