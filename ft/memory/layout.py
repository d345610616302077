"""The one place where a geometry becomes bytes.

A pool is made of tensors whose leading dimension is the pool's unit (a KV page, a mamba slot, an
expert slot). `MemoryLayout` knows each tensor's bytes per unit (measured from real tensors), the
allocator's granularity (each tensor's allocation is rounded up to it: 2 MiB VMM chunks, 4 KiB
host pages), and whether a resize reallocates (then a tensor's old and new allocations are both
held while it copies). Everything that needs bytes (startup sizes, plans, ranges, the ladder, the
admin API) asks this module, so the advertised figures are the allocator's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

POOLS = ("moe", "kv", "mamba")


@dataclass(frozen=True)
class Geometry:
    """Sizes of the three pools, in the units users see (slots, tokens, slots)."""

    moe_slots: int
    kv_tokens: int
    mamba_slots: int

    def size(self, pool: str) -> int:
        return {"moe": self.moe_slots, "kv": self.kv_tokens, "mamba": self.mamba_slots}[pool]

    def with_size(self, pool: str, size: int) -> "Geometry":
        sizes = {**self.sizes(), pool: size}
        return Geometry(sizes["moe"], sizes["kv"], sizes["mamba"])

    def sizes(self) -> dict[str, int]:
        return {"moe": self.moe_slots, "kv": self.kv_tokens, "mamba": self.mamba_slots}


@dataclass(frozen=True)
class UnitCosts:
    """Bytes of one unit of each pool (exact, before rounding): for display and exchange rates."""

    kv_page: int
    page_size: int
    mamba_slot: int
    expert_slot: int


@dataclass(frozen=True)
class MemoryLayout:
    """row_bytes: per pool, the bytes per unit of each of its tensors. page_size: tokens per KV
    page (the KV pool's unit). granularity: bytes each tensor's allocation rounds up to.
    reallocates: a resize holds a tensor's old and new allocation at once. backend: the storage
    backend's name ("vmm", "mmap", "realloc")."""

    row_bytes: dict[str, tuple[int, ...]]
    page_size: int
    granularity: int
    reallocates: bool
    backend: str

    # ------------------------------------------------------------------------- units and bytes
    def units(self, pool: str, size: int) -> int:
        """Rows of the pool's tensors for a size in user units (KV tokens round up to pages)."""
        return -(-size // self.page_size) if pool == "kv" else size

    def round_size(self, pool: str, size: int) -> int:
        """The size a pool really gets for a requested size (KV: whole pages)."""
        return self.units(pool, size) * self.page_size if pool == "kv" else size

    def _alloc(self, nbytes: int) -> int:
        g = self.granularity
        return -(-nbytes // g) * g

    def tensor_bytes(self, pool: str, size: int) -> list[int]:
        """Allocator bytes of each of the pool's tensors at `size`."""
        n = self.units(pool, size)
        return [self._alloc(n * r) for r in self.row_bytes[pool]]

    def pool_bytes(self, pool: str, size: int) -> int:
        return sum(self.tensor_bytes(pool, size))

    def nbytes(self, g: Geometry) -> int:
        """Allocator bytes of a whole geometry."""
        return sum(self.pool_bytes(p, g.size(p)) for p in POOLS)

    def unit_costs(self) -> UnitCosts:
        r = self.row_bytes
        return UnitCosts(sum(r["kv"]), self.page_size, sum(r["mamba"]), sum(r["moe"]))

    # ------------------------------------------------------------------------- one resize
    def resize_peak(self, pool: str, old: int, new: int, total_before: int) -> tuple[int, int]:
        """(peak bytes while the pool goes from `old` to `new`, total after), starting from
        `total_before` bytes held by all pools. Tensors resize one after another; a mapping
        backend frees or maps in place (peak = the larger end), a reallocating one holds each
        tensor's old and new allocation while it copies."""
        olds, news = self.tensor_bytes(pool, old), self.tensor_bytes(pool, new)
        total, peak = total_before, total_before
        for o, n in zip(olds, news):
            peak = max(peak, total + n if self.reallocates else total - o + n)
            total += n - o
        return peak, total

    # ------------------------------------------------------------------------- search
    def largest(self, pool: str, fits, lo: int, hi: int) -> int:
        """The largest size in [lo, hi] (user units; KV in whole pages) for which `fits(size)`,
        given that `fits` is monotone (true up to some size, false above); lo - 1 if none."""
        step = self.page_size if pool == "kv" else 1
        a, b = -(-lo // step), hi // step  # in units
        if a > b or not fits(a * step):
            return lo - 1
        while a < b:
            mid = (a + b + 1) // 2
            if fits(mid * step):
                a = mid
            else:
                b = mid - 1
        return a * step
