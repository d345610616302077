"""The memory budget of the cache pools, their unit costs, and the startup geometry.

Budget: after the resident weights load, `free x memory_ratio - activation reserve`, where the
card is the real device or, with `gpu_memory_limit`, a card of that size (on CPU the limit plays
the card, with a small default so the demo shows real trade-offs). Unit costs come from real
tensors: a pool of one page / slot is built and its bytes read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ft.engine.errors import ConfigError
from ft.units import format_bytes

CPU_DEFAULT_CARD = 96 * 1024**2


@dataclass(frozen=True)
class UnitCosts:
    """Bytes of one KV page (all full-attention layers, K and V), one mamba slot, one expert slot."""

    kv_page: int
    page_size: int
    mamba_slot: int
    expert_slot: int


@dataclass(frozen=True)
class Geometry:
    """Sizes of the three pools, in the units users see (slots, tokens, slots)."""

    moe_slots: int
    kv_tokens: int
    mamba_slots: int

    def nbytes(self, c: UnitCosts) -> int:
        return self.moe_slots * c.expert_slot + (self.kv_tokens // c.page_size) * c.kv_page + self.mamba_slots * c.mamba_slot


@dataclass(frozen=True)
class MemoryBudget:
    card_bytes: int
    free_bytes: int  # after the resident weights
    reserve_bytes: int  # activations of the largest forward pass
    budget_bytes: int  # what the cache pools may use together


def measure_budget(
    device: torch.device, resident_bytes: int, memory_ratio: float, gpu_memory_limit: int | None, reserve_bytes: int,
    cap: int | None = None,
) -> MemoryBudget:
    if not 0 < memory_ratio <= 1:
        raise ConfigError(f"--memory-ratio must be in (0, 1], got {memory_ratio}")
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        card = total
        if gpu_memory_limit:
            card = min(total, gpu_memory_limit)
            free = max(0, min(free, card - (total - free)))
            torch.cuda.set_per_process_memory_fraction(card / total, device)
    else:
        card = gpu_memory_limit or CPU_DEFAULT_CARD
        free = max(0, card - resident_bytes)
    budget = int(free * memory_ratio) - reserve_bytes
    if cap is not None:
        budget = min(budget, cap)
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the cache pools: card {format_bytes(card)}, weights "
            f"{format_bytes(resident_bytes)}, activation reserve {format_bytes(reserve_bytes)}; "
            "raise --gpu-memory-limit or --memory-ratio"
        )
    return MemoryBudget(card, free, reserve_bytes, budget)


def startup_geometry(
    budget: MemoryBudget,
    costs: UnitCosts,
    *,
    total_experts: int,
    expert_floor: int,
    context_limit: int,
    mamba_slots: int,
    num_tokens: int | None,
    moe_backend: str,
    moe_cache_size: int | None,
) -> Geometry:
    """Sizes at startup. KV: `num_tokens` or the whole context; MoE: resident (every expert),
    an explicit size, or auto (what the budget leaves, at most every expert). Refuses, with the
    figures, any combination that does not fit."""
    page = costs.page_size
    total = budget.budget_bytes
    fixed = mamba_slots * costs.mamba_slot
    if moe_backend == "resident":
        moe = total_experts
    elif moe_cache_size is not None:
        if moe_cache_size < expert_floor:
            raise ConfigError(f"--moe-cache-size {moe_cache_size} is below the expert floor {expert_floor}")
        moe = min(moe_cache_size, total_experts)
    else:
        moe = None
    want_tokens = num_tokens if num_tokens is not None else context_limit
    kv_pages = -(-want_tokens // page)
    if num_tokens is None:
        # default KV: the whole context when it fits beside the experts, else what is left
        experts_bytes = (moe if moe is not None else expert_floor) * costs.expert_slot
        fit = (total - fixed - experts_bytes) // costs.kv_page
        kv_pages = max(1, min(kv_pages, fit))
    if moe is None:
        left = total - fixed - kv_pages * costs.kv_page
        moe = min(total_experts, max(0, left // costs.expert_slot))
        if moe < expert_floor:
            raise ConfigError(
                f"the expert cache gets {moe} slots after KV ({kv_pages * page} tokens) and mamba "
                f"({mamba_slots} slots); it needs at least {expert_floor}. Budget {format_bytes(total)}: "
                "lower --num-tokens or raise --gpu-memory-limit"
            )
    geo = Geometry(moe, kv_pages * page, mamba_slots)
    need = geo.nbytes(costs)
    if need > total:
        raise ConfigError(
            f"cache pools need {format_bytes(need)} (moe {moe} slots x {format_bytes(costs.expert_slot)}, "
            f"kv {geo.kv_tokens} tokens, mamba {mamba_slots} slots) but the budget is {format_bytes(total)}"
            + ("; the resident backend keeps every expert on the device: try --moe-backend offload" if moe_backend == "resident" else "")
        )
    return geo
