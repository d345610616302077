"""The memory budget of the cache pools and the startup geometry.

Budget: after the resident weights load, `free - headroom - activation reserve` (the headroom:
`headroom_for`, --memory-ratio's share or the default's), where the
card is the real device or, with `gpu_memory_limit`, a card of that size (on CPU the limit plays
the card, with a small default so the demo shows real trade-offs). Unit costs come from real
tensors (`ft.engine.cache.manager`), and every byte figure comes from `layout.MemoryLayout`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ft.memory.layout import Geometry, MemoryLayout
from ft.errors import ConfigError
from ft.units import format_bytes

log = logging.getLogger("ft.memory")

CPU_DEFAULT_CARD = 96 * 1024**2


@dataclass(frozen=True)
class MemoryBudget:
    card_bytes: int
    free_bytes: int  # after the resident weights
    reserve_bytes: int  # activations of the largest forward pass
    budget_bytes: int  # what the cache pools may use together
    headroom_bytes: int = 0  # kept back from the pools and the reserve (`headroom_for`; `ft.memory.device_memory`)


PREFILL_CHUNK_BY_CARD = ((72 << 30, 16384), (36 << 30, 8192))
"""(card bytes at least, tokens per prefill chunk) for `default_prefill_length`; smaller cards 4,096. The
bounds sit under the sizes cards are sold by, since a card reports less: an H100 80GB 79.6 GiB
(81,559 MiB), an A100 80GB 79.3 GiB, an A100 40GB 39.4 GiB. (At 80 GiB the H100 took 8,192-token
chunks: issue 40's c32 8K / 1K serving row ran 1,181 tok/s in them and 1,390 in 16,384-token ones, with
the mixed step's decode rows batched too, H100, bench/RESULTS.md session 51.)"""


STREAMED_PREFILL_CHUNKS = (16384, 8192, 4096)
"""Chunk sizes `streamed_prefill_length` picks from, largest first."""
STREAMED_PREFILL_SHARE = 0.10
"""The share of the card a streamed prefill chunk's activations may take (`streamed_prefill_length`)."""


def card_bytes(device: torch.device, gpu_memory_limit: int | None) -> int:
    """The card the budget sees: the device's memory, or --gpu-memory-limit when smaller (on the CPU
    the limit, else `CPU_DEFAULT_CARD`)."""
    if device.type != "cuda":
        return gpu_memory_limit or CPU_DEFAULT_CARD
    card = torch.cuda.get_device_properties(device).total_memory
    return min(card, gpu_memory_limit) if gpu_memory_limit else card


def default_prefill_length(device: torch.device, gpu_memory_limit: int | None) -> int:
    """Tokens per prefill chunk when --max-prefill-length is not given, by the card the budget sees
    (`card_bytes`): 16,384 from 72 GiB (80 GB cards), 8,192 from 36 GiB, else 4,096 (and on the CPU). Why: a long
    prompt's chunks each read the whole cached prefix, so fewer, larger chunks cost less (H200,
    flagship, a 256K prompt: 20.1 s in chunks of 4,096 against 19.5 s in chunks of 16,384,
    bench/prefill.py, 2026-12-01), while the activation reserve grows with the chunk: a small card
    keeps its slots for experts and KV. An offloaded card whose chunks stream their experts takes
    `streamed_prefill_length` instead, when larger."""
    if device.type != "cuda":
        return 4096
    card = card_bytes(device, gpu_memory_limit)
    return next((chunk for size, chunk in PREFILL_CHUNK_BY_CARD if card >= size), 4096)


def streamed_prefill_length(card: int, reserve_for: Callable[[int], int]) -> int:
    """Tokens per prefill chunk of an offloaded card whose chunks stream the experts the cache lacks:
    the largest of `STREAMED_PREFILL_CHUNKS` whose chunk-sized reserve (`reserve_for(tokens)`: the
    activations and the streamed passes' workspace, in bytes) is at most `STREAMED_PREFILL_SHARE` of
    the card's bytes, else the smallest. Why: every chunk streams the same bytes (what the cache
    lacks, ~23 GB on a 32 GiB card for the 80B), so a chunk's time is nearly flat in its tokens
    and 4x the tokens is ~4x the speed (H200, 32 GiB card, 8K prompt: 2,673 tok/s in 4,096-token
    chunks, 11,541 in 16,384; bench/RESULTS.md 2026-12-03), while the reserve's bytes leave the expert
    slots (16,384 tokens of the 80B: 2.7 GiB, ~1,500 slots): a tenth of the card gives the 32 GiB
    card 16,384 and the 16 GiB card 8,192."""
    return next((c for c in STREAMED_PREFILL_CHUNKS if reserve_for(c) <= STREAMED_PREFILL_SHARE * card),
                STREAMED_PREFILL_CHUNKS[-1])


def experts_can_all_be_resident(moe_backend: str, moe_cache_size: int | None, total_experts: int,
                                expert_bytes: int, budget_bytes: int) -> bool:
    """Whether an expert cache under this budget could ever hold every expert (what a prefill graph
    needs: `ModelRunner` replays them only then): always with the resident backend; offloaded, only
    when no --moe-cache-size below the model's experts caps it and the experts' `expert_bytes` (all
    layers, as the host store holds them) fit the cache budget with nothing else beside them. Why:
    a prefill graph's pool is reserved from the budget, and an offloaded card that can never hold
    every expert would reserve it for graphs it never captures (the 80B on a 32 GiB card: 321 MiB,
    ~190 expert slots)."""
    if moe_backend == "resident" or total_experts == 0:
        return True
    if moe_cache_size is not None and moe_cache_size < total_experts:
        return False
    return expert_bytes <= budget_bytes


HEADROOM_SHARE = 0.10
"""The default headroom's share of the free memory (`headroom_for`), up to `HEADROOM_CAP`."""
HEADROOM_CAP = 1 << 30
"""The most the default headroom keeps back, in bytes (`headroom_for`)."""


def headroom_for(free: int, memory_ratio: float | None, capped: bool = True) -> int:
    """Bytes of the free memory (after the weights) that neither the pools nor the activation reserve may
    use: what nothing plans for (library workspaces, the CUDA context's growth as kernels load, the caching
    allocator's fragments). With --memory-ratio R (in (0, 1]: `measure_budget` checks), free x (1 - R);
    by default `HEADROOM_SHARE` of it, and where `capped` at most `HEADROOM_CAP`. The caller caps where
    the bytes buy speed and the cap was measured: experts offloaded on one GPU, where each GiB is ~400
    to ~600 expert slots (an NCCL communicator's buffers, under tensor parallelism, come after the
    budget; a resident card's KV beyond its requests' needs buys nothing). What the card kept
    untouched under load with the cap: bench/RESULTS.md, session 54."""
    if memory_ratio is not None:
        return free - int(free * memory_ratio)
    share = free - int(free * (1 - HEADROOM_SHARE))
    return min(share, HEADROOM_CAP) if capped else share


def measure_budget(
    device: torch.device, resident_bytes: int, memory_ratio: float | None, gpu_memory_limit: int | None,
    reserve_bytes: int, cap: int | None = None, capped_headroom: bool = False,
) -> MemoryBudget:
    """The cache pools' budget: the free memory after the weights, less the headroom (`headroom_for`,
    `capped_headroom` its `capped`) and `reserve_bytes`, at most `cap`; ConfigError when nothing is left."""
    if memory_ratio is not None and not 0 < memory_ratio <= 1:  # (before the device is touched)
        raise ConfigError(f"--memory-ratio must be in (0, 1], got {memory_ratio}")
    if device.type == "cuda":
        # Why: blocks torch's caching allocator still holds from loading (temporaries of a dequantization, of
        # synthetic weights drawn on the device) count as used by the driver, yet the pools map their memory
        # through the driver (`ft.memory.vmm`) and can never have them: free is measured with them returned
        held = torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        returned = held - torch.cuda.memory_reserved(device)
        if returned:
            log.info("budget: %s of blocks the caching allocator held since loading returned before the free memory "
                     "is measured", format_bytes(returned))
        free, total = torch.cuda.mem_get_info(device)
        card = total
        if gpu_memory_limit:
            card = min(total, gpu_memory_limit)
            free = max(0, min(free, card - (total - free)))
            torch.cuda.set_per_process_memory_fraction(card / total, device)
    else:
        card = gpu_memory_limit or CPU_DEFAULT_CARD
        free = max(0, card - resident_bytes)
    headroom = headroom_for(free, memory_ratio, capped_headroom)
    budget = free - headroom - reserve_bytes
    if cap is not None:
        budget = min(budget, cap)
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the cache pools: card {format_bytes(card)}, weights "
            f"{format_bytes(resident_bytes)}, activation reserve {format_bytes(reserve_bytes)}; "
            "raise --gpu-memory-limit or --memory-ratio"
        )
    return MemoryBudget(card, free, reserve_bytes, budget, headroom)


def startup_geometry(
    budget: MemoryBudget,
    layout: MemoryLayout,
    *,
    total_experts: int,
    expert_floor: int,
    context_limit: int,
    mamba_slots: int,
    num_tokens: int | None,
    moe_backend: str,
    moe_cache_size: int | None,
    kv_fill_limit: int = 0,
) -> Geometry:
    """Sizes at startup. KV: `num_tokens` or the whole context; MoE: resident (every expert),
    an explicit size, or auto (what the budget leaves, at most every expert). With `kv_fill_limit`
    (tokens, > 0) and no `num_tokens`, once every expert has its slot the KV grows into what the
    budget still leaves, up to that many tokens (room for many requests' prompts at once; the caller
    passes what its running requests could ever hold: more would only be mapped and never used).
    Refuses, with the figures, any combination that does not fit. Bytes are the layout's
    (allocator) bytes."""
    page = layout.page_size
    total = budget.budget_bytes
    c = layout.unit_costs()
    if moe_backend == "resident":
        moe = total_experts
    elif moe_cache_size is not None:
        if moe_cache_size < expert_floor:
            raise ConfigError(f"--moe-cache-size {moe_cache_size} is below the expert floor {expert_floor}")
        moe = min(moe_cache_size, total_experts)
    else:
        moe = None
    kv = layout.round_size("kv", num_tokens if num_tokens is not None else context_limit)
    if num_tokens is None:
        # default KV: the whole context when it fits beside the experts, else what is left
        experts = moe if moe is not None else expert_floor
        fit = layout.largest("kv", lambda s: layout.nbytes(Geometry(experts, s, mamba_slots)) <= total, page, kv)
        kv = max(page, fit)
    if moe is None:
        moe = max(0, layout.largest("moe", lambda s: layout.nbytes(Geometry(s, kv, mamba_slots)) <= total,
                                    0, total_experts))
        if moe < expert_floor:
            kv_bytes = layout.nbytes(Geometry(0, kv, 0)) - layout.nbytes(Geometry(0, 0, 0))
            mamba_bytes = layout.nbytes(Geometry(0, 0, mamba_slots)) - layout.nbytes(Geometry(0, 0, 0))
            raise ConfigError(
                f"the expert cache gets {moe} slots after KV ({kv} tokens, {format_bytes(kv_bytes)}) and mamba "
                f"({mamba_slots} slots, {format_bytes(mamba_bytes)}); it needs at least {expert_floor}. Budget "
                f"{format_bytes(total)}: lower --num-tokens, or --max-running-requests / --mamba-cache-size (the "
                "mamba slots: one per running request, plus the prefix cache's), or raise --gpu-memory-limit / "
                "--cache-budget"
            )
    if kv_fill_limit > 0 and num_tokens is None and moe >= total_experts:
        # Why: with every expert resident nothing else can use the budget; one context of KV on an
        # H200 left 62 GiB idle while 32 requests of 9K tokens queued for pages (bench/RESULTS.md,
        # session 28). The expert cache's trade (the KV ladder) only applies when experts are missing.
        most = min(kv + page * (total // max(1, c.kv_page) + 1), layout.round_size("kv", kv_fill_limit))
        kv = max(kv, layout.largest("kv", lambda s: layout.nbytes(Geometry(moe, s, mamba_slots)) <= total, kv, most))
    geo = Geometry(moe, kv, mamba_slots)
    need = layout.nbytes(geo)
    if need > total:
        raise ConfigError(
            f"cache pools need {format_bytes(need)} (moe {moe} slots x {format_bytes(c.expert_slot)}, "
            f"kv {geo.kv_tokens} tokens, mamba {mamba_slots} slots) but the budget is {format_bytes(total)}"
            + ("; the resident backend keeps every expert on the device: try --moe-backend offload" if moe_backend == "resident" else "")
        )
    return geo
