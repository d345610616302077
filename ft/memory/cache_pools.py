"""The three pools a model reads and writes, and the storage that backs them."""

from __future__ import annotations

from dataclasses import dataclass

from ft.memory.expert_cache import ExpertCache
from ft.memory.kv_pool import KVPool
from ft.memory.mamba_pool import MambaPool
from ft.memory.storage import PoolStorage


@dataclass
class CachePools:
    kv: KVPool
    mamba: MambaPool
    experts: ExpertCache | None
    storage: PoolStorage

    def sizes(self) -> dict[str, int]:
        """What the pools really hold, in user units: moe slots, kv tokens, mamba slots."""
        return {"moe": self.experts.num_slots if self.experts else 0, "kv": self.kv.num_tokens,
                "mamba": self.mamba.num_slots}
